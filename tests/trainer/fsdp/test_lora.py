"""LoRA on the FSDP trainer: the adapters' gradients are the float64 reference's under
every layout and mode (and a planted error is caught), a step moves the adapters and
nothing else, resume from an adapter checkpoint equals the uninterrupted run, the merged
export computes the adapted model's logits, and the adapters alone reach an engine whose
log-probs then equal the trainer's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout.tiny import create_tiny_checkpoint
from tests.distributed import run_ranks
from tests.trainer.helpers import random_train_batch, sampled_train_batch
from trainer.config import (
    AggregationConfig,
    LoraConfig,
    LossConfig,
    ObjectiveConfig,
    OptimizerConfig,
    TrainerConfig,
)

MODES = ("sample_mean", "token_mean", "prompt_mean", "constant")
LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def _config(**update: object) -> TrainerConfig:
    base = TrainerConfig(lora=LORA, loss=LossConfig(kl_coef=0.1, entropy_coef=0.01),
                         optimizer=OptimizerConfig(lr=1e-2), max_tokens_per_micro_batch=20)
    return TrainerConfig.model_validate(base.model_dump() | update)


@pytest.mark.slow
def test_adapter_gradients_match_the_float64_reference_under_every_layout(
        ray_cluster: None, tiny_model: str) -> None:
    """Every mode and term: the adapters' summed gradients (A and B, B perturbed off 0)
    and J under packed DP 2 and CP 2 equal one padded float64 rank's; a ×2 planted in the
    pg and KL weights of one layout fails exactly its rows."""
    from transformers import AutoConfig

    from trainer.planted import parse_planted
    from trainer.verify import Layout, verify_layouts

    batch = random_train_batch(AutoConfig.from_pretrained(tiny_model).vocab_size,
                               num_prompts=4, group_size=2, seed=3)
    config = _config()
    objective = ObjectiveConfig.compose(AggregationConfig(), config.loss, 8, 0.7)
    planted = Layout(1, 1, packed=True)  # one rank: the cheapest layout to plant in
    rows = verify_layouts(config, objective, tiny_model, batch,
                          [Layout(1, 1, packed=False), Layout(2, 1, packed=True),
                           Layout(1, 2), planted],
                          modes=MODES, planted={str(planted): parse_planted("pg,kl")})
    assert len(rows) == 3 * 4 * 3
    good = [r for r in rows if r.layout != str(planted)]
    assert all(r.ok for r in good), [r for r in good if not r.ok][:3]
    assert max(r.grad_rel for r in good) < 1e-9  # float64: rounding only
    bad = {(r.mode, r.term) for r in rows if r.layout == str(planted) and not r.ok}
    assert bad == {(m, t) for m in MODES for t in ("pg", "kl")}


def _steps(rank: int, port: int, model_path: str, batch, dp: int, dtype: str,
           num_steps: int, save: str | None = None, save_at: int | None = None,
           resume_from: str | None = None) -> dict[str, object]:
    """``num_steps`` steps (a checkpoint to ``save`` and the weights then after
    ``save_at`` of them); with ``resume_from``, that checkpoint loaded over the trained
    state afterwards and one more step. One process group serves several tests' runs:
    each spawn imports torch and transformers anew."""
    from trainer.backends.fsdp.worker import FSDPWorker
    from trainer.step_plan import plan_step

    config = _config(dp_size=dp, dtype=dtype)
    objective = ObjectiveConfig.compose(AggregationConfig(), config.loss, 10, 1.0)
    worker = FSDPWorker(config, objective, model_path, rank, total_steps=4)
    _setup(worker, port)
    before = worker.export_weights()
    plan = plan_step(batch, objective, dp, 1, max_tokens_per_micro_batch=64)
    metrics, at_save = [], None
    for step in range(1, num_steps + 1):
        metrics.append(worker.train_step(batch, plan))
        if save and step == save_at:
            worker.save_checkpoint(save)
            at_save = worker.export_weights()
    after = worker.export_weights()
    frozen = {str(p.dtype) for p in worker.model.parameters() if not p.requires_grad}
    trained = {str(p.dtype) for p in worker.model.parameters() if p.requires_grad}
    states = {str(s["exp_avg"].dtype) for s in worker.optimizer.state.values()}
    num_states = len(worker.optimizer.state)
    resumed = None
    if resume_from:
        worker.load_checkpoint(resume_from)
        worker.train_step(batch, plan)
        resumed = worker.export_weights()
    return {"before": before, "after": after, "at_save": at_save, "resumed": resumed,
            "metrics": metrics, "dtypes": (frozen, trained, states),
            "num_states": num_states}


_SPAWN_STORES: list = []
"""In a spawned rank: the store its first run joined through, then one entry per later run
(:func:`_setup`)."""


def _setup(worker, port: int) -> None:
    """``worker.setup``; a run after a spawn's first (:func:`_in_turn`) joins through the
    first one's store under a key prefix of its own: the other ranks learn rank 0's port
    once per spawn, and no two groups share a rendezvous key."""
    import torch.distributed as dist

    if _SPAWN_STORES:
        worker._store = dist.PrefixStore(f"run{len(_SPAWN_STORES)}/", _SPAWN_STORES[0])
    worker.setup("127.0.0.1", port)
    _SPAWN_STORES.append(worker._store)


def _in_turn(rank: int, port: int, runs: list[tuple[object, tuple]]) -> list[object]:
    """Several runs of one world size in turn in the same processes (a spawn imports torch
    and transformers anew, most of a small run's cost), each in a process group of its
    own, torn down before the next."""
    import torch.distributed as dist

    results = []
    for fn, args in runs:
        results.append(fn(rank, port, *args))
        dist.barrier()  # every rank done with this group before any tears it down
        dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def spawned(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The gloo runs of four tests in two spawns. DP 2: two float32 steps then a save (the
    resume test's checkpoint), then two bfloat16 steps (the step test's DP 2 case). DP 1:
    three float32 steps with a save after two (the step test's DP 1 case and the export
    test read the state after two, the resume test's uninterrupted run the state after
    three), then DP 2's checkpoint loaded over that and one more step (the resumed run);
    then the engine test's run."""
    batch = sampled_train_batch(tiny_model, temperature=1.0)
    root = tmp_path_factory.mktemp("lora_runs")
    dp2, dp1 = root / "dp2", root / "dp1_step2"
    _, bf16 = run_ranks(_in_turn, 2, [
        (_steps, (tiny_model, batch, 2, "float32", 2, str(dp2), 2)),
        (_steps, (tiny_model, batch, 2, "bfloat16", 2))])[0]
    float32, engine = run_ranks(_in_turn, 1, [
        (_steps, (tiny_model, batch, 1, "float32", 3, str(dp1), 2, str(dp2))),
        (_engine_after_adapter_sync,
         (tiny_model, sampled_train_batch(tiny_model, temperature=0.7)))])[0]
    return {"batch": batch, "dp2": dp2, "dp1": dp1, "result": float32, "bfloat16": bf16,
            "engine": engine}


@pytest.mark.slow
@pytest.mark.parametrize(("dp", "dtype"), [(1, "float32"), (2, "bfloat16")])
def test_a_step_moves_the_adapters_and_leaves_the_base_bit_identical(
        spawned: dict[str, object], dp: int, dtype: str) -> None:
    if dtype == "float32":  # DP 1's first two steps of the shared run
        result = spawned["result"]
        after, metrics = result["at_save"], result["metrics"][:2]
    else:  # DP 2's bfloat16 run of two steps
        result = spawned["bfloat16"]
        after, metrics = result["after"], result["metrics"]
    before = result["before"]
    adapters = {name for name in before if ".lora_" in name}
    assert adapters and len(adapters) == result["num_states"]  # AdamW state: adapters only
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == adapters  # every A and B moved, no base tensor did
    assert len(adapters) == 2 * 7 * 2  # all-linear: 2 layers × 7 Linear modules × (A, B)
    frozen, trained, states = result["dtypes"]
    assert trained == {"torch.float32"} and states == {"torch.float32"}  # fp32 masters
    assert frozen == {f"torch.{dtype}"}  # the base in the compute dtype
    assert len(metrics) == 2
    assert all(m["kl"] >= 0 for m in metrics) and metrics[-1]["kl"] > 0


@pytest.mark.slow
def test_resume_from_an_adapter_checkpoint_equals_the_uninterrupted_run(
        spawned: dict[str, object]) -> None:
    """Two steps at DP 2 then a save, one more step after loading it at DP 1 (DCP
    reshards): the adapters of three steps in one go, up to the rounding of a sum over two
    ranks (bit for bit at one DP size: tests/e2e/test_lora_job.py). The checkpoint
    holds adapters and their AdamW state only, and peft's adapter folder."""
    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemReader

    result, saved = spawned["result"], spawned["dp2"]
    whole, resumed = result["after"], result["resumed"]
    for name in whole:
        torch.testing.assert_close(resumed[name], whole[name], rtol=1e-5, atol=1e-5,
                                   msg=name)
    stored = FileSystemReader(str(saved / "shards")).read_metadata().state_dict_metadata
    model_keys = [k for k in stored if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys)  # no base weight stored
    with safe_open(str(saved / "adapter" / "adapter_model.safetensors"), "pt") as f:
        assert len(list(f.keys())) == len(model_keys)


@pytest.mark.slow
def test_merged_export_and_the_adapter_folder_compute_the_adapted_models_logits(
        tiny_model: str, spawned: dict[str, object], tmp_path: Path) -> None:
    """After two steps: the merged export, loaded by plain transformers, and the base
    with peft's adapter folder give the trainer's own logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.export import export_checkpoint

    batch, saved = spawned["batch"], spawned["dp1"]
    at_save = spawned["result"]["at_save"]  # the trainer's weights at the save
    merged = AutoModelForCausalLM.from_pretrained(export_checkpoint(saved, tmp_path / "hf"))
    adapter = export_checkpoint(saved, tmp_path / "adapter", adapter=True)
    with_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model),
                                          str(adapter))
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model),
                                        str(adapter))
    trained.load_state_dict(at_save)  # the trainer's exported weights
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    ids = batch.input_ids[:4]
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        for model in (merged, with_peft):
            torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5,
                                       atol=1e-5)
        assert (base(input_ids=ids).logits - want).abs().max() > 1e-3  # the adapters matter


@pytest.mark.slow  # builds the model and runs preflight
def test_bad_lora_settings_name_their_field(tiny_model: str) -> None:
    from transformers import AutoModelForCausalLM

    from services.config.errors import ConfigError
    from services.config.job import parse_job_config
    from trainer.lora import LoraTargetError, check_targets

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with pytest.raises(LoraTargetError, match=r"trainer.lora.target_modules: qq_proj is not "
                                              r"a Linear module of the model; it has .*q_proj"):
        check_targets(LoraConfig(target_modules=["q_proj", "qq_proj"]), model)
    check_targets(LoraConfig(target_modules=["q_proj", "down_proj"]), model)
    for overrides, said in (
            (["trainer.lora.rank=0"], "trainer.lora.rank: Input should be greater than 0"),
            (["trainer.lora.rank=8", "trainer.backend=megatron"],
             "trainer: lora: LoRA adapters are trained by backend=fsdp only"),
            (["trainer.lora.dropout=1"], "trainer.lora.dropout: Input should be less than 1"),
            (["trainer.lora.target_modules=[]"], "trainer.lora.target_modules"),
            (["rollout.engine.type=sglang", "trainer.lora.rank=8",
              "rollout.engine.max_lora_rank=4"],
             "rollout.engine.max_lora_rank: 4 is below trainer.lora.rank 8"),
    ):
        with pytest.raises(ConfigError) as err:
            parse_job_config("", overrides)
        assert said in str(err.value)
    job = parse_job_config("", ["trainer.lora.rank=8", "colocate=true"])
    assert job.weight_transport() == "object_store"  # adapters go to engine actors
    from services.runtime.preflight import preflight  # before Ray starts: nothing is started

    with pytest.raises(ConfigError, match=r"trainer.lora.target_modules: qkv is not a "
                                          r"Linear module of qwen2 models"):
        preflight(parse_job_config("", ["trainer.lora.target_modules=[q_proj, qkv]"]))


def _engine_after_adapter_sync(rank: int, port: int, model_path: str, batch
                               ) -> dict[str, float]:
    """Two big steps, the adapters through the buckets into a torch engine, a batch that
    engine samples, then the trainer's log-prob mismatch on it; the same for an engine
    that got no sync (the control)."""
    from rollout.config import TorchEngineConfig
    from rollout.engines.torch_engine import TorchEngine
    from rollout.weight_bucket import WeightBucket
    from tests.trainer.helpers import sampled_train_batch as sample
    from trainer.backends.fsdp.worker import FSDPWorker
    from trainer.step_plan import plan_step

    config = _config(optimizer=OptimizerConfig(lr=5e-2), loss=LossConfig(
        old_log_probs="rollout"))
    objective = ObjectiveConfig.compose(AggregationConfig(), config.loss, 10, 0.7)
    worker = FSDPWorker(config, objective, model_path, rank, total_steps=2)
    _setup(worker, port)
    plan = plan_step(batch, objective, 1, 1, max_tokens_per_micro_batch=64)
    for _ in range(2):
        worker.train_step(batch, plan)
    specs = worker.weight_bucket_specs("float32", 0.01)  # several buckets of 10 KB
    buckets = [WeightBucket(s, flat.numpy())
               for s, flat in zip(specs, worker.weight_buckets("float32", 0.01), strict=True)]
    out = {"buckets": len(buckets), "bytes": sum(b.num_bytes for b in buckets),
           "full_bytes": sum(p.numel() * 4 for p in worker.model.parameters())}
    engine_config = TorchEngineConfig(batch_size=8)
    for synced in (True, False):
        engine = TorchEngine(engine_config, model_path)
        if synced:
            engine.load_weight_buckets(buckets, version=1)
            out["version"] = engine.weight_version
        sampled = sample(model_path, 0.7, seed=5, engine_config=engine_config,
                         engine=engine)
        sampled_plan = plan_step(sampled, objective, 1, 1, max_tokens_per_micro_batch=64)
        (sums, _), = worker.gradients(sampled, [sampled_plan], [objective])
        out["synced" if synced else "unsynced"] = sums["mismatch/log_prob_abs_diff"]
    return out


@pytest.mark.slow
def test_an_engine_after_an_adapter_sync_gives_the_trainers_log_probs(
        spawned: dict[str, object]) -> None:
    result = spawned["engine"]  # run in DP 1's spawn, in a process group of its own
    assert result["version"] == 1 and result["buckets"] > 1
    assert result["synced"] < 1e-5  # mean |log π_trainer − log π_engine| per token, fp32
    assert result["unsynced"] > 1e-3  # an engine still serving the base is visibly off
    assert result["bytes"] < 0.2 * result["full_bytes"]  # adapters only
