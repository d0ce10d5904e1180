"""The verifier's rollout for a job with partial rollouts (``rollout.partial_rollout``): a
batch whose samples span two and three weight versions, drawn by the job's own rollout
manager, and the check that each token's behaviour log-prob is its own version's.

    steps 0 … DRAW_STEPS − 1: before step s ≥ 1 weights version s loaded (the start weights
    moved by their own noise, trainer/verify.perturbed) ─► manager.generate_batch(s); the
    last step's batch is the verifier's, and its ``spans`` row says whether it holds
    samples of exactly two versions and of three or more (else the check would be moot)

The pool is drawn DRAW_DEPTH deep ((1 + 4) · P groups in flight, staleness up to 8),
whatever the job's async_steps: with short answers (the demo's copy task) a pool of
(1 + 1) · P groups hands on nearly every sample within two calls, and a sample spanning
three versions is what the check needs. How deep the pool was changes nothing the layouts
compare.

The layouts then train that batch as for any job (every mode, each layout against the
reference), with the job's off-policy correction reading each token's own behaviour
log-prob. Before that, :func:`behaviour_row` holds every response token's rollout log-prob
to a float64 teacher-forced pass of the weights of the version it records: a pool that
gave a sample one version (the planted ``one_version_per_sample``) fails it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from rollout.batch import RolloutBatch
    from trainer.verify import Row

DRAW_DEPTH = 4
"""rollout.async_steps of the verifier's pool (its size (1 + DRAW_DEPTH) · P)."""
DRAW_STEPS = 4
"""Steps drawn; the demo's batch of the last holds 2- and 3+-version samples (168 and 45 of 256)."""
VERSION_NOISE = 0.5
"""The noise of each weight version (× each tensor's std): versions far enough apart that
one token's log-prob tells them apart (≫ the engine's float32 rounding)."""
BEHAVIOUR_ATOL = 1e-4
"""|rollout log-prob − float64 reference| allowed: the engine computes in float32."""


def draw_partial_rollout(rollout_config: object, model_path: str,
                         planted: frozenset[str] = frozenset()
                         ) -> tuple[RolloutBatch, dict[int, dict[str, torch.Tensor]]]:
    """(the batch, its weights by version) as the module docstring draws them;
    ``rollout_config``: the job's rollout as the verifier runs it (reward spread);
    ``planted``: errors planted in the manager's pool (the verify-only ``plant``)."""
    import ray
    from safetensors.torch import load_file

    from rollout.config import RolloutConfig
    from services.verify.aggregation import rollout_manager
    from trainer.verify import perturbed

    base: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        base.update(load_file(str(file)))
    rollout_config = RolloutConfig.model_validate({
        **rollout_config.model_dump(),  # type: ignore[attr-defined]
        "async_steps": DRAW_DEPTH, "max_staleness": 2 * DRAW_DEPTH})
    with rollout_manager(rollout_config, model_path) as manager:
        if planted:
            ray.get(manager.plant.remote(planted))
        weights = {0: base}
        for step in range(DRAW_STEPS):
            if step:
                weights[step] = perturbed(base, seed=step, scale=VERSION_NOISE)
                ray.get(manager.update_weights.remote([ray.put(weights[step])], step))
            batch = ray.get(manager.generate_batch.remote(step))
        return batch, weights


def spans_row(batch: RolloutBatch) -> Row:
    """ok when the batch holds a sample of exactly two versions and one of three or more
    (``grad_abs``: how many of each)."""
    from trainer.verify import Row

    spans = version_spans(batch)
    two, more = spans.count(2), sum(n >= 3 for n in spans)
    return Row(layout="engine", mode=f"{two}×2,{more}×3+", update=0, term="spans",
               grad_abs=float(two), grad_rel=0.0, value_abs=float(more), value_rel=0.0,
               ok=two > 0 and more > 0)


def version_spans(batch: RolloutBatch) -> list[int]:
    """How many weight versions each sample's response tokens come from."""
    assert batch.token_versions is not None
    response = batch.loss_mask > 0
    return [len(set(batch.token_versions[i][response[i]].tolist()))
            for i in range(batch.num_samples)]


def behaviour_row(batch: RolloutBatch, weights: dict[int, dict[str, torch.Tensor]],
                  model_path: str, temperature: float) -> Row:
    """Every response token's rollout log-prob against log softmax(z / T) of the
    sampled token under its own version's weights, float64, teacher-forced (engines/
    base.py's convention); ok within :data:`BEHAVIOUR_ATOL`."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout.engines.sampling import scaled_logits
    from trainer.verify import Row

    assert batch.token_versions is not None
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64).eval()
    response = batch.loss_mask > 0
    positions = torch.arange(batch.input_ids.shape[1])
    attention = (positions < batch.sequence_lengths[:, None]).long()
    expected = torch.zeros(batch.input_ids.shape, dtype=torch.float64)
    for version in batch.token_versions[response].unique().tolist():
        model.load_state_dict({k: v.double() for k, v in weights[version].items()},
                              strict=False)
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=attention).logits
        log_probs = scaled_logits(logits[:, :-1], temperature).log_softmax(-1).gather(
            -1, batch.input_ids[:, 1:, None]).squeeze(-1)
        mine = response[:, 1:] & (batch.token_versions[:, 1:] == version)
        expected[:, 1:] = torch.where(mine, log_probs.double(), expected[:, 1:])
    diff = (batch.rollout_log_probs.double() - expected).abs()[response]
    worst = float(diff.max()) if diff.numel() else 0.0
    scale = float(expected[response].abs().max()) if diff.numel() else 1.0
    spans = version_spans(batch)
    return Row(layout="engine", mode=f"v≤{max(spans)}/sample", update=0, term="behav",
               grad_abs=worst, grad_rel=worst / max(scale, 1e-30), value_abs=worst,
               value_rel=worst / max(scale, 1e-30), ok=worst <= BEHAVIOUR_ATOL)
