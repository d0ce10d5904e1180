"""Single-turn rollouts: one response per request, scored by the parts of rollout.reward.

    requests ─► engines (each shard as it finishes) ─► decoded ─► reward parts ─► Samples

A training play scores each engine's shard as soon as that engine is done, so reward
actors work while the other engines still generate; an evaluation scores all its plays
in one batch once they are generated (reward models and judges see the batches they
always saw) and leaves the parts' running statistics as they are.
"""

from __future__ import annotations

import time
from typing import Any

from transformers import PreTrainedTokenizerBase

from rollout.engines.base import Generation
from rollout.reward_parts import Rewarder, RewardScores
from rollout.rollouts.base import Play, Played, Request, Rollout, Sample, ShardsAsDone, StepStats
from rollout.tokenizer import decode_responses


class SingleTurn(Rollout):
    """A prompt in, one response out, its reward from rollout.reward."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, rewarder: Rewarder,
                 shards_as_done: ShardsAsDone) -> None:
        self.tokenizer, self.rewarder, self.shards_as_done = tokenizer, rewarder, shards_as_done

    def play(self, plays: list[Play], training: bool) -> Played:
        started = time.perf_counter()
        policy_prompts: dict[tuple[int, ...], str] = {}  # the prompt as the policy saw it
        shards: list[tuple[int, int, list[Generation], list[str], Any]] = []
        for number, play in enumerate(plays):
            prompts = [r.ids for r in play.requests]
            for (a, b), shard in self.shards_as_done(prompts, play.sampling, play.key,
                                                     play.draw):
                texts = decode_responses(self.tokenizer, [g.token_ids for g in shard])
                pending = (self.rewarder.submit(*self._shard(play.requests[a:b], texts,
                                                             policy_prompts))
                           if training else None)
                shards.append((number, a, shard, texts, pending))
        generated = time.perf_counter()
        shards.sort(key=lambda shard: shard[:2])
        requests = [r for play in plays for r in play.requests]
        generations = [g for _, _, shard, _, _ in shards for g in shard]
        texts = [t for _, _, _, shard_texts, _ in shards for t in shard_texts]
        pendings = ([pending for *_, pending in shards] if training else
                    [self.rewarder.submit(*self._shard(requests, texts, policy_prompts))])
        scores = self.rewarder.collect(pendings, update_stats=training)
        return Played(self._samples(requests, generations, texts, scores),
                      gen_time_s=generated - started,
                      reward_s=time.perf_counter() - generated, scores=scores)

    def score(self, requests: list[Request], generations: list[Generation]) -> Played:
        """Training samples of responses generated elsewhere (rollout/partial.py: continued
        over several engine calls), scored in one batch; ``gen_time_s`` is the caller's."""
        started = time.perf_counter()
        texts = decode_responses(self.tokenizer, [g.token_ids for g in generations])
        scores = self.rewarder.collect([self.rewarder.submit(*self._shard(requests, texts, {}))],
                                       update_stats=True)
        return Played(self._samples(requests, generations, texts, scores),
                      reward_s=time.perf_counter() - started, scores=scores)

    @staticmethod
    def _samples(requests: list[Request], generations: list[Generation], texts: list[str],
                 scores: RewardScores) -> list[Sample]:
        return [Sample(r.record, r.ids, generation, scores.total[i], texts[i],
                       {name: values[i] for name, values in scores.parts.items()},
                       answers={name: answers[i] for name, answers in scores.answers.items()})
                for i, (r, generation) in enumerate(zip(requests, generations, strict=True))]

    def _shard(self, requests: list[Request], texts: list[str],
               policy_prompts: dict[tuple[int, ...], str]) -> tuple[list[Any], ...]:
        """Rewarder.submit's arguments for ``requests`` and their responses."""
        for r in requests:
            if (key := tuple(r.ids)) not in policy_prompts:
                policy_prompts[key] = self.tokenizer.decode(r.ids, skip_special_tokens=False)
        return ([policy_prompts[tuple(r.ids)] for r in requests],
                [r.record.prompt for r in requests], texts,
                [r.record.label for r in requests], [r.record.metadata for r in requests])

    def finish(self, stats: StepStats, step: int
               ) -> tuple[dict[str, float], list[tuple[str, str]]]:
        """Each reward part's errors of the step against what it allows (RewardError)."""
        self.rewarder.check_errors(stats.errors, stats.num_samples, step)
        return {}, []
