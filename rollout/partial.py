"""Partial rollouts: samples that go on across weight updates, and steps formed from the
whole groups that finish first (``rollout.partial_rollout``, with ``async_steps`` = k ≥ 1).

    in flight: (1 + k) · P groups (P: the rollout's prompts), each sample with its tokens
               so far, their behaviour log-probs and the weight version of each token
    the call for step s, under the manager's weights v:
      1. a group holding a token older than s − max_staleness leaves the pool (counted in
         samples: ``rollout/stale_dropped``); by default none does (below)
      2. round r: the pool is topped up from the cursor, then every unfinished sample
         decodes up to C = partial_chunk_tokens more tokens (one engine call; the context is
         its prompt + its tokens so far; seeds from (seed, s, r, engine rank), r counting
         every round of the run). Its new tokens are version v. A group whose last sample
         ended is done at round r.
      3. rounds until P groups are done (and one at least in a call, so every unfinished
         sample gains ≥ C tokens a call); the step takes the first P (by round, then by
         admission) and the rest wait for the next step; unfinished samples pause at this
         token boundary and go on under the weights the next call has.

A sample whose first token came at call s (weights s − k) may still be in the pool at
call s − k + max_staleness. Gaining ≥ C tokens a call it is done by call
s + max_new_tokens / C − 1, and a done group waits at most k calls to be taken (at most
k · P groups are done beyond a step's P, and the earliest done go first): with
max_staleness ≥ 2k − 1 + max_new_tokens / C, the default, no group is ever dropped for
staleness and none starves. A smaller bound drops the groups of the longest responses.
      dynamic sampling on the stream: the groups taken are scored, those without reward
      spread set aside and as many more taken (more rounds), max_draws takes in all;
      set-aside groups then fill in (rollout/manager.py).

Why the pause is a chunk boundary of the step's call rather than the moment new weights
arrive (AReaL's interruption): what is in flight then depends on the config alone, never
on timing, so a checkpoint of the pool (:meth:`PartialRollouts.state_dict`) resumes bit for
bit and the verifier can rebuild a step. A weight load queues behind the call
(rollout/engine_weights.py), so the next call's tokens are the new version's, and the long
tail no longer holds a step: a long response keeps generating into later steps while short
groups fill this one.

Continuing a sample re-sends its whole context. The torch engine keeps each row's KV
between the rounds of one version (its prefix cache, as an EpisodeTurn of the set
``partial``) and prefills only the last token; after a weight load the kept KV is of old
weights, so the first round of a call prefills each context again (re-prefill; its cost is
measured in docs/rollout.md). SGLang's radix cache keeps what it can on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout.engines.base import FinishReason, Generation

PLANTED_ONE_VERSION = "one_version_per_sample"
"""A verifier's planted error (trainer/planted.py), never production's: a continued
sample's tokens all tagged with the version of its first token, as if a sample had one
version; the verifier's check of each token's behaviour log-prob against its version's
weights must catch it (services/verify/partial.py)."""

PARTIAL_EPISODES = "partial"
"""The EpisodeTurn set the rounds' engine calls name, so the torch engine keeps each
row's KV from one round to the next (rollout/engines/prefix_cache.py)."""

Admit = Callable[[int], list[tuple[int, list[int]]]]
"""count -> that many (record index, prompt ids) from the cursor."""

Decode = Callable[[list[list[int]], int], list[Generation]]
"""(contexts, round number) -> up to C new tokens each, tagged with their weight version.
The round number counts every round of the run (checkpointed): the seed key."""


@dataclass
class InFlight:
    """One sample in flight: what it has generated so far."""

    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    """Each token's behaviour log-prob, under the weights that sampled it."""
    versions: list[int] = field(default_factory=list)
    """The weight version that sampled each token."""
    finish: FinishReason | None = None
    """None while it generates; its engine's finish reason once it ended."""

    def generation(self) -> Generation:
        assert self.finish is not None
        return Generation(list(self.tokens), list(self.log_probs), self.finish,
                          list(self.versions))


@dataclass
class InFlightGroup:
    """One record's G samples in flight."""

    record: int
    """The dataset record's index."""
    prompt_ids: list[int]
    admitted: int
    """Its admission number: the order among groups done in the same round."""
    samples: list[InFlight]
    done_round: int | None = None
    """The round (overall) its last sample ended in; None while one generates."""


@dataclass
class PartialStats:
    """One step's call: what it cost and what it dropped."""

    rounds: int = 0
    decoded_tokens: int = 0
    """Tokens the engines generated in this call (for every sample in flight)."""
    stale_dropped: int = 0
    admitted_groups: int = 0


class PartialRollouts:
    """The pool of groups in flight and the rounds that advance it (module docstring)."""

    def __init__(self, group_size: int, max_new_tokens: int, chunk_tokens: int,
                 pool_groups: int, max_staleness: int) -> None:
        if max_new_tokens % chunk_tokens:
            raise ValueError(f"partial_chunk_tokens: {chunk_tokens} does not divide "
                             f"max_new_tokens={max_new_tokens}")
        self.group_size, self.max_new_tokens = group_size, max_new_tokens
        self.chunk_tokens, self.pool_groups = chunk_tokens, pool_groups
        self.max_staleness = max_staleness
        self.groups: list[InFlightGroup] = []
        self.next_admission = 0
        self.rounds = 0
        """Rounds played so far, every step's: the turn number of the engines' kept KV."""
        self.planted: frozenset[str] = frozenset()
        """A verifier's planted errors (:data:`PLANTED_ONE_VERSION`); empty in production."""

    def take(self, num_groups: int, admit: Admit, decode: Decode, stats: PartialStats,
             call_start: bool = True) -> list[InFlightGroup]:
        """The first ``num_groups`` groups done (rounds played until that many are),
        removed from the pool. ``call_start``: the first take of a step's call (dynamic
        sampling takes again), which plays one round at least while a sample is
        unfinished, so every sample gains ≥ C tokens a call."""
        if call_start:
            # A round number skipped: the engines drop the KV kept by the last call's
            # rounds (prefix_cache.py drops an entry two turns old), so each call prefills
            # its contexts afresh, as a resumed run's first call must (its engines kept
            # nothing): bit for bit, even when no weight load came between two calls.
            self.rounds += 1
        played = not call_start
        while len(done := self._done()) < num_groups or (not played and any(
                s.finish is None for g in self.groups for s in g.samples)):
            self._top_up(admit, stats)
            self._round(decode, stats)
            played = True
        taken = done[:num_groups]
        chosen = {id(g) for g in taken}
        self.groups = [g for g in self.groups if id(g) not in chosen]
        return taken

    def drop_stale(self, step: int) -> int:
        """Every group holding a token older than step − max_staleness leaves the pool (a
        new group takes its place); returns how many samples went. With the default bound
        none ever does (module docstring; rollout/config.py ``staleness_bound``)."""
        oldest_allowed = step - self.max_staleness
        stale = [g for g in self.groups
                 if any(s.versions and s.versions[0] < oldest_allowed for s in g.samples)]
        self.groups = [g for g in self.groups if g not in stale]
        return sum(len(g.samples) for g in stale)

    def _done(self) -> list[InFlightGroup]:
        return sorted((g for g in self.groups if g.done_round is not None),
                      key=lambda g: (g.done_round, g.admitted))

    def _top_up(self, admit: Admit, stats: PartialStats) -> None:
        missing = self.pool_groups - len(self.groups)
        if missing <= 0:
            return
        for record, prompt_ids in admit(missing):
            self.groups.append(InFlightGroup(record, list(prompt_ids), self.next_admission,
                                             [InFlight() for _ in range(self.group_size)]))
            self.next_admission += 1
            stats.admitted_groups += 1

    def _round(self, decode: Decode, stats: PartialStats) -> None:
        """Every unfinished sample decodes up to C more tokens under the engines' current
        weights (``decode`` tags each response with their version)."""
        active = [(group, sample) for group in self.groups for sample in group.samples
                  if sample.finish is None]
        generations = decode([group.prompt_ids + sample.tokens for group, sample in active],
                             self.rounds)
        if len(generations) != len(active):
            raise RuntimeError(f"partial rollout: {len(generations)} responses for "
                               f"{len(active)} samples in flight")
        for (_, sample), generation in zip(active, generations, strict=True):
            version = _version_of(generation)
            if PLANTED_ONE_VERSION in self.planted and sample.versions:
                version = sample.versions[0]
            sample.tokens += generation.token_ids
            sample.log_probs += generation.log_probs
            sample.versions += [version] * len(generation.token_ids)
            stats.decoded_tokens += len(generation.token_ids)
            if not generation.token_ids and generation.finish_reason == "length":
                raise RuntimeError("partial rollout: an engine returned no token for an "
                                   "unfinished sample (it would never end)")
            if generation.finish_reason != "length":
                sample.finish = generation.finish_reason
            elif len(sample.tokens) >= self.max_new_tokens:
                sample.finish = "length"
        for group in self.groups:
            if group.done_round is None and all(s.finish is not None for s in group.samples):
                group.done_round = self.rounds
        self.rounds += 1
        stats.rounds += 1

    # -- what a checkpoint keeps -------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The pool as JSON data (log-probs are Python floats: exact through JSON), copied:
        the pool's own lists grow in place as it decodes."""
        return {
            "next_admission": self.next_admission,
            "rounds": self.rounds,
            "groups": [{"record": g.record, "prompt_ids": list(g.prompt_ids),
                        "admitted": g.admitted, "done_round": g.done_round,
                        "samples": [{"tokens": list(s.tokens),
                                     "log_probs": list(s.log_probs),
                                     "versions": list(s.versions), "finish": s.finish}
                                    for s in g.samples]}
                       for g in self.groups],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_admission = int(state["next_admission"])
        self.rounds = int(state["rounds"])
        self.groups = [
            InFlightGroup(int(g["record"]), [int(t) for t in g["prompt_ids"]],
                          int(g["admitted"]),
                          [InFlight([int(t) for t in s["tokens"]],
                                    [float(x) for x in s["log_probs"]],
                                    [int(v) for v in s["versions"]], s["finish"])
                           for s in g["samples"]],
                          None if g["done_round"] is None else int(g["done_round"]))
            for g in state["groups"]]


def _version_of(generation: Generation) -> int:
    """The weight version a round's response was sampled from (the decode call tags it:
    every token of one engine call has its engine's one version)."""
    if generation.versions is None or len(set(generation.versions)) > 1:
        raise ValueError("partial rollout: a round's response must carry its one weight "
                         "version (Generation.versions)")
    return generation.versions[0] if generation.versions else 0


def step_metrics(generations: list[Generation], step: int) -> dict[str, float]:
    """Over a step's samples: ``rollout/partial_fraction`` (samples whose tokens span more
    than one version) and, over their tokens, ``rollout/staleness_mean`` and
    ``rollout/staleness_max`` (step − the token's version)."""
    spans = [len(set(g.versions or [])) > 1 for g in generations]
    lags = [step - v for g in generations for v in (g.versions or [])]
    return {"rollout/partial_fraction": sum(spans) / len(spans) if spans else 0.0,
            "rollout/staleness_mean": sum(lags) / len(lags) if lags else 0.0,
            "rollout/staleness_max": float(max(lags)) if lags else 0.0}
