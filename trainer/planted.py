"""Errors a test plants in a verifier's ranks, so it can show the verifier catching each.

Not a user option, and never read from the environment. The verifier is handed them as
a parameter (``services/verify``: ``{layout: Planted}``) and injects one layout's set
into the ranks it builds (``TrainerRank.plant``, a verify-only verb, before any step);
each rank keeps its share (:func:`rank_planted`) and hands it, as a parameter, to what
makes the error: the row layout (``micro_batch.slice_for_plan``), the objective, the
value loss. Production never calls ``plant``: every rank's set is ``NOTHING_PLANTED``.

    pg, kl, entropy       rank 0's share of that term's gradient doubled
    value                 the critic's rank 0: its share of the value loss's gradient
                          doubled (trainer/value_loss.py)
    local_whitening       GAE's advantages whitened with each DP rank's own statistics
                          (mean and std of its samples' tokens) instead of the rollout's
                          (services/verify/critic.py: the classic silent error)
    local_tokens          every rank normalises by its own tokens (the bug Tally exists to
                          prevent): a term's weights become w·S/(R·s), s = Σ w over the
                          rank's tokens of the call, S = Σ s over the R ranks; for
                          token_mean that is 1/(R·ΣM_j over the rank's samples): a
                          per-rank mean averaged over ranks, exact only when every rank
                          holds the same share (s = S/R). A call is one micro-batch: the
                          rank's whole share when it has one (as in the tests)
    shard_coefficient     rank 0's shard (one CP shard in a CP layout): the coefficient of
                          its sample with the most valid tokens ×(1 + 1e-3), every term
    entropy_coefficient   the same sample's coefficient ×(1 + 1e-3) in the entropy term only
    prefix_mask           shared prefix (trainer/row_layout.py): a response also sees its
                          head's last prompt token, a copy of its own first token (the
                          off-by-one a prefix mask invites), every rank
    observation_tokens    multi-turn: a response's observation tokens (mask 0 between two
                          of its valid tokens) trained as actions, each with the weight of
                          its sample's valid token before it, in every term, every rank
                          (M_i, T_g unchanged; a CP shard finds those between the valid
                          tokens it holds); the FSDP backend, which computes log-probs
                          at the loss mask's positions only, computes them there too
                          (``objective.planted_loss_mask``)
    one_version_per_sample  partial rollouts: a continued sample's tokens all tagged with
                          its first token's weight version (planted in the rollout
                          manager's pool, rollout/partial.py; the verifier's check of each
                          token's behaviour log-prob against its version catches it)

Rank 0 is the one that owns the first DP×CP shard (every TP rank of it on Megatron).
"""

from __future__ import annotations

from enum import StrEnum


class PlantedError(StrEnum):
    """One planted error (the table above). A member equals its name as a string, so a
    set of them answers ``"pg" in planted``."""

    PG = "pg"
    KL = "kl"
    ENTROPY = "entropy"
    VALUE = "value"
    LOCAL_WHITENING = "local_whitening"
    LOCAL_TOKENS = "local_tokens"
    SHARD_COEFFICIENT = "shard_coefficient"
    ENTROPY_COEFFICIENT = "entropy_coefficient"
    PREFIX_MASK = "prefix_mask"
    OBSERVATION_TOKENS = "observation_tokens"
    ONE_VERSION_PER_SAMPLE = "one_version_per_sample"


Planted = frozenset[PlantedError]
"""The errors planted in one layout's ranks (or the share one rank makes)."""

NOTHING_PLANTED: Planted = frozenset()

PLANTED_FACTOR_TERMS = ("pg", "kl", "entropy")
"""Planted errors that double rank 0's share of a term."""
PLANTED_ON_EVERY_RANK: Planted = frozenset({
    PlantedError.LOCAL_TOKENS, PlantedError.PREFIX_MASK, PlantedError.OBSERVATION_TOKENS})
"""Planted errors each rank of the layout makes; the others only rank 0 does."""
PLANTED_COEFFICIENT_ERROR = 1e-3
"""Relative error of the one wrong per-sample coefficient (shard_ / entropy_coefficient)."""


def parse_planted(text: str) -> Planted:
    """``pg,local_tokens`` -> those errors; an unknown name raises ValueError (a test hook
    that planted nothing would pass silently)."""
    names = {name.strip() for name in text.split(",") if name.strip()}
    unknown = sorted(names - set(PlantedError))
    if unknown:
        raise ValueError(f"unknown planted error(s) {unknown}; expected some of "
                         f"{sorted(PlantedError)}")
    return frozenset(PlantedError(name) for name in names)


def rank_planted(planted: Planted, first_shard: bool) -> Planted:
    """The errors one rank of a layout that plants ``planted`` makes: the every-rank
    ones, and all of them on a rank of the first DP×CP shard (every TP rank of it on
    Megatron: each computes that replica's loss)."""
    return planted if first_shard else planted & PLANTED_ON_EVERY_RANK
