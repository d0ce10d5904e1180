"""An LLM judge (``type: judge``, rollout/judge.py): torch engine actors in the gang, or
a server at ``url`` asked from a thread here. An answer that does not parse
(rollout/judge_parse.py: no score, not finite, out of range) is an unscored sample
(None), counted as ``reward/<name>/unparsed``; a call to ``url`` that failed (no answer)
is unscored too. ``reward/<name>/unscored`` counts both. Each raw answer is kept
(:attr:`PartScores.answers`, samples.jsonl's ``judge_answers``).

A request over the judge's prompt budget has its response cut, or is not sent and its
sample left unscored (rollout/judge.py), counted in ``reward/<name>/over_budget``: in the
gang the judge's actor holds its requests to min(max_prompt_tokens, its context −
max_new_tokens); with ``url`` this process holds them to max_prompt_tokens, counted with
``tokenizer``."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from rollout.remote import CallTally, check_unscored
from rollout.reward_config import JudgeConfig
from rollout.reward_parts.base import PartScores, RewardPart, RewardShard
from rollout.reward_parts.model import actor_shards

Graded = tuple[list[str | None], float, int]
"""A shard's answers (None: unscored before parsing), seconds its actors spent, and its
requests over the prompt budget."""


def _gathered(refs: list[Any]) -> Graded:
    """The actors' :meth:`JudgeEngine.grade` answers to ``refs``, in order, summed."""
    import ray

    answers: list[str | None] = []
    seconds, over = 0.0, 0
    for shard, busy, over_budget in ray.get(refs):
        answers += shard
        seconds += busy
        over += over_budget
    return answers, seconds, over


class JudgePart(RewardPart):
    """A language model grading each response by ``template``; its answer parsed."""

    config: JudgeConfig
    count_names: ClassVar[tuple[str, ...]] = ("unparsed", "unscored", "over_budget",
                                              "failed_calls", "retries")

    def __init__(self, config: JudgeConfig) -> None:
        super().__init__(config)
        self.actors: list[Any] = []
        self._server: ThreadPoolExecutor | None = None
        self._tokenizer: Any = None
        """With url and max_prompt_tokens: the served model's tokenizer (at bind)."""

    def actor_bundles(self) -> list[dict[str, float]]:
        if self.config.url is not None:
            return []  # the server is someone else's
        bundle = {"CPU": self.config.num_cpus, "GPU": self.config.num_gpus}
        return [{k: v for k, v in bundle.items() if v}] * self.config.num_actors

    def check(self, field: str) -> None:
        from rollout.token_budget import judge_problem, model_context

        part = self.config
        if part.url is not None:
            if part.tokenizer is not None:
                from rollout.reward_checks import check_local_folder

                check_local_folder(part.tokenizer, f"{field}.tokenizer", "tokenizer")
            return
        from rollout.pretrained import ModelImportError, check_model

        try:
            check_model(part.model)
        except ModelImportError as err:
            raise ModelImportError(f"{field}.{err}") from None
        problem = judge_problem(model_context(part.model), part.max_new_tokens,
                                part.max_prompt_tokens)
        if problem is not None:
            raise ValueError(f"{field}.{problem}")

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
        if self.config.tokenizer is not None and self._tokenizer is None:
            from rollout.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.config.tokenizer)

    def submit(self, shard: RewardShard) -> tuple[Callable[[], Graded], CallTally]:
        """(a call that waits for (the answers, None where a call to ``url`` failed or
        the request was over budget and not sent; the seconds the actors spent; requests
        over the budget), what the calls to ``url`` cost)."""
        part = self.config
        tally = CallTally()
        if self._server is not None:  # a server's time is not the job's
            future = self._server.submit(self._ask, shard, tally)
            return future.result, tally
        refs = [actor.grade.remote(part.template, shard.raw_prompts[a:b],
                                   shard.responses[a:b], shard.labels[a:b],
                                   part.max_new_tokens, part.max_prompt_tokens,
                                   part.truncation)
                for actor, (a, b) in zip(self.actors, actor_shards(len(shard),
                                                                   len(self.actors)),
                                         strict=False)]
        return (lambda: _gathered(refs)), tally

    def _ask(self, shard: RewardShard, tally: CallTally) -> Graded:
        """The server's answers to ``shard``'s requests, held to max_prompt_tokens."""
        from rollout.judge import ask_server, fit_requests

        part = self.config
        budget = part.max_prompt_tokens if self._tokenizer is not None else None
        requests, over = fit_requests(self._tokenizer, part.template, shard.raw_prompts,
                                      shard.responses, shard.labels, budget,
                                      part.truncation)
        return ask_server(part, requests, None, tally), 0.0, over

    def collect(self, handles: list[tuple[Callable[[], Graded], CallTally]],
                update_stats: bool = True) -> PartScores:
        """The parsed scores; more failed calls than ``max_unscored_fraction`` of the
        step raise (rollout/remote.py: a fault the driver restarts from the checkpoint)."""
        from rollout.judge_parse import parse_score

        answers: list[str | None] = []
        busy_s, over_budget = 0.0, 0
        total = CallTally()
        for wait, tally in handles:
            shard, seconds, over = wait()
            answers += shard
            busy_s += seconds
            over_budget += over
            total.add(tally)
        check_unscored(self.name, total, len(answers), self.config.max_unscored_fraction)
        values = [None if answer is None else parse_score(answer, self.config.parse)
                  for answer in answers]
        unparsed = sum(a is not None and v is None for a, v in zip(answers, values,
                                                                   strict=True))
        return PartScores(values, busy_s, answers=answers,
                          counts={"unparsed": unparsed,
                                  "unscored": sum(v is None for v in values),
                                  "over_budget": over_budget,
                                  **total.counts()})
