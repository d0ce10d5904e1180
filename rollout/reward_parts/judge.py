"""An LLM judge (``type: judge``, rollout/judge.py): torch engine actors in the gang, or
a server at ``url`` asked from a thread here. An answer that does not parse
(rollout/judge_parse.py: no score, not finite, out of range) is an unscored sample
(None), counted as ``reward/<name>/unparsed``; a call to ``url`` that failed (no answer)
is unscored too. ``reward/<name>/unscored`` counts both. Each raw answer is kept
(:attr:`PartScores.answers`, samples.jsonl's ``judge_answers``)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from rollout.remote import CallTally, check_unscored
from rollout.reward_config import JudgeConfig
from rollout.reward_parts.base import PartScores, RewardPart, RewardShard
from rollout.reward_parts.model import actor_shards, gather


class JudgePart(RewardPart):
    """A language model grading each response by ``template``; its answer parsed."""

    config: JudgeConfig
    count_names: ClassVar[tuple[str, ...]] = ("unparsed", "unscored", "failed_calls",
                                              "retries")

    def __init__(self, config: JudgeConfig) -> None:
        super().__init__(config)
        self.actors: list[Any] = []
        self._server: ThreadPoolExecutor | None = None

    def actor_bundles(self) -> list[dict[str, float]]:
        if self.config.url is not None:
            return []  # the server is someone else's
        bundle = {"CPU": self.config.num_cpus, "GPU": self.config.num_gpus}
        return [{k: v for k, v in bundle.items() if v}] * self.config.num_actors

    def check(self, field: str) -> None:
        if self.config.url is not None:
            return
        from rollout.pretrained import ModelImportError, check_model

        try:
            check_model(self.config.model)
        except ModelImportError as err:
            raise ModelImportError(f"{field}.{err}") from None

    def start_actors(self, resolve: Callable[[str], str],
                     options: list[dict[str, Any]]) -> list[Any]:
        import ray

        from rollout.config import TorchEngineConfig
        from rollout.judge import JudgeEngine

        part = self.config
        engine = TorchEngineConfig(
            num_engines=part.num_actors, num_cpus=part.num_cpus, num_gpus=part.num_gpus,
            device="cuda" if part.num_gpus > 0 else "cpu",
            dtype=("bfloat16" if part.num_gpus > 0 else "float32") if part.dtype == "auto"
            else part.dtype, num_threads=max(1, int(part.num_cpus)), prefix_cache_mb=0)
        path = resolve(part.model)
        actor = ray.remote(JudgeEngine)
        return [actor.options(num_cpus=part.num_cpus, num_gpus=part.num_gpus, **option)
                .remote(engine, path, path, rank) for rank, option in enumerate(options)]

    def bind(self, actors: list[Any]) -> None:
        self.actors = actors
        if self.config.url is not None and self._server is None:
            self._server = ThreadPoolExecutor(max_workers=2)

    def submit(self, shard: RewardShard) -> tuple[Callable[[], tuple[list[str | None],
                                                                    float]], CallTally]:
        """(a call that waits for (the answers, None where a call to ``url`` failed; the
        seconds the actors spent), what the calls to ``url`` cost)."""
        from rollout.judge import ask_server, judge_request

        requests = [judge_request(self.config.template, p, r, label) for p, r, label in
                    zip(shard.raw_prompts, shard.responses, shard.labels, strict=True)]
        tally = CallTally()
        if self._server is not None:  # a server's time is not the job's
            future = self._server.submit(ask_server, self.config, requests, None, tally)
            return (lambda: (future.result(), 0.0)), tally
        refs = [actor.answer.remote(requests[a:b], self.config.max_new_tokens)
                for actor, (a, b) in zip(self.actors, actor_shards(len(requests),
                                                                   len(self.actors)),
                                         strict=False)]
        return (lambda: gather(refs)), tally

    def collect(self, handles: list[tuple[Callable[[], tuple[list[str | None], float]],
                                          CallTally]],
                update_stats: bool = True) -> PartScores:
        """The parsed scores; more failed calls than ``max_unscored_fraction`` of the
        step raise (rollout/remote.py: a fault the driver restarts from the checkpoint)."""
        from rollout.judge_parse import parse_score

        answers: list[str | None] = []
        busy_s = 0.0
        total = CallTally()
        for wait, tally in handles:
            shard, seconds = wait()
            answers += shard
            busy_s += seconds
            total.add(tally)
        check_unscored(self.name, total, len(answers), self.config.max_unscored_fraction)
        values = [None if answer is None else parse_score(answer, self.config.parse)
                  for answer in answers]
        unparsed = sum(a is not None and v is None for a, v in zip(answers, values,
                                                                   strict=True))
        return PartScores(values, busy_s, answers=answers,
                          counts={"unparsed": unparsed,
                                  "unscored": sum(v is None for v in values),
                                  **total.counts()})
