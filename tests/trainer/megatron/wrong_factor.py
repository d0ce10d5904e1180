"""A Megatron rank with a planted SUM-factor error, for showing ``equivalence.assert_same``
failing (``test_backend_equivalence``): the group imports it in place of the backend's
worker (``trainer.group.WORKER_CLASSES``)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from trainer.backends.megatron.worker import MegatronWorker
from trainer.micro_batch import MicroBatch


class MissingMicroBatchFactorWorker(MegatronWorker):
    """Scales the local loss by dp instead of ``megatron_sum_factor``'s dp·K, leaving in
    Megatron's division by the K micro-batches: the optimizer sees ∇J / K."""

    def _forward_step(self, scale: int, mode_names: list[str],
                      data_iterator: Iterator[MicroBatch], model: torch.nn.Module
                      ) -> tuple[torch.Tensor, object]:
        return super()._forward_step(self.config.dp_size, mode_names, data_iterator, model)
