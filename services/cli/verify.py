"""The verifier commands: ``verify-aggregation`` and ``verify-objective`` (the programs:
services/verify/) and ``aggregation-demo``."""

from __future__ import annotations

from typing import Annotated

import typer

from services.cli.common import ConfigArg, SetOpt, load_job
from services.runtime.exit_codes import FAILED, Refused


def verify_aggregation(
    config: ConfigArg, set_: SetOpt = None,
    layouts: Annotated[str, typer.Option(
        help="comma-separated, the first the reference, e.g. dp1cp1-padded,dp2cp1-prefix,"
             "dp1cp2 (-padded / -packed / -prefix force padding, packing, packing with each "
             "group's prompt shared; plain: the job's)")]
    = "dp1cp1-padded,dp2cp1-prefix,dp1cp2",
    rtol: Annotated[float | None, typer.Option(
        help="relative tolerance (default 1e-7 on FSDP in float64, 1e-4 on Megatron)")] = None,
    atol: Annotated[float | None, typer.Option(
        help="tolerance relative to the term's own scale (‖∇‖∞, Σ|w·ℓ|)")] = None,
) -> int:
    """Each term's summed gradient and J of every optimizer step of one rollout under each
    layout, against the first layout, for every aggregation mode; exit 1 on a difference
    above |Δ| ≤ rtol·|ref| + atol·scale."""
    from services.verify.aggregation import parse_layouts
    from services.verify.aggregation import verify_aggregation as run

    job = load_job(config, set_)
    try:
        parsed = parse_layouts(layouts)
    except ValueError as err:
        raise Refused(f"error: {err}") from None
    return run(job, parsed, rtol, atol, echo=typer.echo)


def verify_objective(config: ConfigArg, set_: SetOpt = None) -> int:
    """Each loss term's exact expected J and ∇J through production's per-token code against
    autograd of its documented formula, on a tiny float64 model over a small vocabulary
    (no Ray, CPU, seconds); exit 1 when any row differs by more than 1e-10."""
    from services.verify.objective import verify_objective as run

    job = load_job(config, set_)
    return run(job.trainer.loss, job.rollout.sampling.temperature, job.critic.value_clip,
               echo=typer.echo)


def aggregation_demo(dp: int = 2, cp: int = 2) -> int:
    """Split one random step over DP × CP gloo processes; print J per mode vs the reference."""
    from services.verify.demo import print_demo

    return 0 if print_demo(dp, cp) else FAILED
