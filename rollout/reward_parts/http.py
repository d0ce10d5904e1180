"""A remote reward endpoint (``type: http``), OpenRLHF's ``remote_rm_url`` shape::

    POST url  {"query":     [policy prompt + response, …],   (OpenRLHF's key)
               "prompts":   [policy prompt, …],
               "responses": [response, …],
               "labels":    [label or null, …]}
    reply     {"rewards": [r, …]}  or  [r, …]                (one finite number each)

A shard is cut into requests of ``batch_size`` samples, sent from a pool of
``max_concurrency`` threads here through rollout/remote.py (timeout, retries with
backoff, the key as a bearer token). A request that still fails leaves its samples
unscored (None), counted as ``reward/<name>/failed_calls`` (and each retry as
``reward/<name>/retries``); a value that is not a finite number is unscored too. When the
unscored samples of failed requests exceed ``max_unscored_fraction`` of the samples
collected, the step fails: RemoteOutage, a fault the driver restarts from the
checkpoint (RemoteRefused, not retried, if the endpoint refused them with a 4xx).
"""

from __future__ import annotations

import math
import random
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

from rollout.remote import (
    CallTally,
    RemoteSettings,
    check_key_file,
    check_unscored,
    post_json,
    read_api_key,
)
from rollout.reward_config import HttpRewardConfig
from rollout.reward_parts.base import PartScores, RewardPart, RewardShard

Handle = tuple[list[Future[list[float | None]]], CallTally]


def request_body(shard: RewardShard, a: int, b: int) -> dict[str, Any]:
    """Samples ``a:b`` of ``shard`` as one request's JSON body."""
    prompts = shard.policy_prompts[a:b]
    responses = shard.responses[a:b]
    return {"query": [p + r for p, r in zip(prompts, responses, strict=True)],
            "prompts": prompts, "responses": responses, "labels": shard.labels[a:b]}


def reply_values(reply: Any, num_samples: int) -> list[float | None] | None:
    """The rewards of a reply (``{"rewards": […]}`` or a list), a value that is not a
    finite number as None; None when the reply is not one value per sample."""
    rewards = reply.get("rewards") if isinstance(reply, dict) else reply
    if not isinstance(rewards, list) or len(rewards) != num_samples:
        return None
    return [float(v) if isinstance(v, int | float) and not isinstance(v, bool)
            and math.isfinite(v) else None for v in rewards]


class HttpPart(RewardPart):
    """Rewards from a remote endpoint, asked from threads of the manager's process."""

    config: HttpRewardConfig
    count_names: ClassVar[tuple[str, ...]] = ("failed_calls", "retries", "unscored")

    def __init__(self, config: HttpRewardConfig) -> None:
        super().__init__(config)
        self._pool: ThreadPoolExecutor | None = None
        self._settings: RemoteSettings | None = None
        self._rng = random.Random()

    def check(self, field: str) -> None:
        check_key_file(self.config.api_key_file, field)

    def bind(self, actors: list[Any]) -> None:
        part = self.config
        self._settings = RemoteSettings(
            part.url, part.timeout_s, part.max_retries, part.backoff_s, part.max_concurrency,
            read_api_key(part.api_key_env, part.api_key_file, f"reward {self.name}"))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=part.max_concurrency,
                                            thread_name_prefix=f"reward-{self.name}")

    def _call(self, body: dict[str, Any], num_samples: int, tally: CallTally
              ) -> list[float | None]:
        assert self._settings is not None
        reply = post_json(self._settings, body, tally, num_samples, self._rng)
        if reply is None:
            return [None] * num_samples
        values = reply_values(reply, num_samples)
        if values is None:  # the same request would get the same answer: not retried
            tally.failed(num_samples, f"{self.config.url}: the reply is not {{\"rewards\": "
                         f"[{num_samples} numbers]}}", refused=True)
            return [None] * num_samples
        return values

    def submit(self, shard: RewardShard) -> Handle:
        assert self._pool is not None, "bind() first: it reads the key"
        tally = CallTally()
        size = self.config.batch_size
        futures = [self._pool.submit(self._call, request_body(shard, a, min(a + size,
                                                                           len(shard))),
                                     min(a + size, len(shard)) - a, tally)
                   for a in range(0, len(shard), size)]
        return futures, tally

    def collect(self, handles: list[Handle], update_stats: bool = True) -> PartScores:
        values: list[float | None] = []
        total = CallTally()
        for futures, tally in handles:
            for future in futures:
                values += future.result()
            total.add(tally)
        check_unscored(self.name, total, len(values), self.config.max_unscored_fraction)
        return PartScores(values, counts={**total.counts(),
                                          "unscored": sum(v is None for v in values)})
