"""The world group's backend serves every device the workers reduce on: on GPU the
logged sums, rank 0's gathered log-probs and checkpoint metadata are CPU tensors, the
gradients CUDA ones (NCCL is not in a CPU build of torch, so the choice is checked as
torch parses it, not by starting NCCL)."""

from __future__ import annotations

from torch.distributed.distributed_c10d import BackendConfig

from trainer.rank import process_group_backend


def test_the_gpu_world_group_serves_cpu_tensors_through_gloo_and_cuda_through_nccl() -> None:
    served = BackendConfig(process_group_backend("cuda")).get_device_backend_map()
    assert served == {"cpu": "gloo", "cuda": "nccl"}
    # plain "nccl" (the earlier choice) leaves CPU tensors with no backend at all
    assert "cpu" not in BackendConfig("nccl").get_device_backend_map()


def test_the_cpu_world_group_is_gloo() -> None:
    assert BackendConfig(process_group_backend("cpu")).get_device_backend_map()["cpu"] == "gloo"
