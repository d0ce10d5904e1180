"""RolloutManager: prompts in, one RolloutBatch per step out.

    dataset ─► PromptCursor ─► P prompts × G ─► Rollout.play ─► engine actors (torch | sglang)
                                                 (rollout/rollouts/: single-turn | episodes)
    RolloutBatch ◄─ advantages ◄─ [dynamic sampling] ◄─ scored samples ◄┘ (in prompt order)
         ▲  the estimator (rollout/advantages/) ◄─ teacher log-probs, when it or
            rollout.teacher needs them (distillation)

One step draws P = N / G prompts and plays G samples of each (a group) through the one
rollout interface, which scores them; evaluation plays held-out prompts through the same
call. The manager then calls the advantage estimator over the final batch, unless it
needs the critic's values (the driver calls it then); a ``rollout.teacher`` beside it
adds its per-token reverse-KL advantage (rollout/teacher.py). Group indices are
contiguous and keep increasing across steps. Sampling seeds are a hash of (seed, step,
round, engine rank): the only mutable state is the data cursor, the next group index and
the weight version (and with partial rollouts the pool in flight), which is what
:meth:`state_dict` saves, so a resumed run continues exactly. Because a shard's seed is its
rank's, a lost engine's shard re-run on a live one gives the same samples
(rollout/engine_pool.py: the driver has the gang replace it); with partial rollouts the
re-run prefills its contexts afresh where the lost engine had kept their KV, so its samples
may differ in the last bits (N and every group stay whole).

Use it as a Ray actor (:data:`RolloutManagerActor`, returned batches travel through the
object store), or in-process inside a Ray driver.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from collections.abc import Iterator
from typing import Any

import ray
import torch

from rollout.advantages import Distill, build_estimator, reverse_kl
from rollout.batch import RolloutBatch, from_wire
from rollout.config import DatasetConfig, RolloutConfig, SamplingConfig, TeacherConfig
from rollout.cursor import PromptCursor
from rollout.datasets import PromptRecord, load_prompt_dataset
from rollout.dynamic_sampling import split_by_spread
from rollout.engine_pool import EnginePool, Shard
from rollout.engine_weights import EngineWeights
from rollout.engines import check_engine_available, engine_actor_options, engine_class
from rollout.engines.base import EpisodeTurn, Generation
from rollout.environments import load_environment_class
from rollout.partial import PARTIAL_EPISODES, PartialRollouts, PartialStats, step_metrics
from rollout.prompts import PromptTooLong, fit_prompt
from rollout.reward_parts import Rewarder
from rollout.rollouts import (
    EvalOutcome,
    EvalRun,
    Play,
    Request,
    Rollout,
    StepStats,
    build_rollout,
    evaluate,
)
from rollout.rollouts.single_turn import SingleTurn
from rollout.rollouts.step import Group, build_batch, groups_of, training_records
from rollout.shards import shard_bounds
from rollout.teacher import Teacher
from rollout.teacher_reward import with_teacher_in_rewards
from rollout.token_budget import model_context, prompt_budget
from rollout.tokenizer import encode_prompt, encode_prompts, load_tokenizer
from rollout.turns import TurnFormat

__all__ = ["EvalOutcome", "EvalRun", "RolloutManager", "RolloutManagerActor", "engine_args",
           "start_engines", "start_teachers"]

ENCODED_PROMPTS = 65536
"""Records whose prompt ids the manager keeps (a small dataset's every record; a big one
is encoded as drawn, its ids never all held)."""


def start_engines(config: RolloutConfig, model_path: str,
                  engine_placement: list[dict[str, Any]] | None = None) -> list[Any]:
    """The engine actors of ``config.engine``, started (not waited for). Called by the
    gang (services/runtime/gang.py), which hands them to the manager: the manager starts
    no actor itself."""
    placement = engine_placement or [{} for _ in range(config.engine.num_engines)]
    return [start_engine(config, model_path, rank, placement[rank])
            for rank in range(config.engine.num_engines)]


def start_engine(config: RolloutConfig, model_path: str, rank: int,
                 placement: dict[str, Any] | None = None) -> Any:
    """Engine ``rank`` of ``config.engine``, started (not waited for): one of
    :func:`start_engines`, or the replacement of a lost one (``placement``: its bundle)."""
    actor_class = ray.remote(engine_class(config.engine))
    return (actor_class.options(**{**engine_actor_options(config.engine), **(placement or {})})
            .remote(*engine_args(config, model_path, rank)))


def engine_args(config: RolloutConfig, model_path: str, rank: int) -> tuple[Any, ...]:
    """Engine ``rank``'s constructor arguments: a start's, or a renewal's in a reused gang
    (services/runtime/gang.py ``warm_gangs``)."""
    return (config.engine, model_path, config.tokenizer or model_path, rank)


def start_teachers(config: TeacherConfig, model_path: str,
                   placement: list[dict[str, Any]] | None = None) -> list[Any]:
    """The teacher actors of ``config`` (rollout/teacher.py), started (not waited for);
    ``placement``: per-actor Ray options (a bundle of the job's placement group)."""
    actor_class = ray.remote(Teacher)
    placement = placement or [{} for _ in range(config.num_actors)]
    return [actor_class.options(num_cpus=config.num_cpus, num_gpus=config.num_gpus,
                                **placement[rank])
            .remote(config, model_path, max(1, int(config.num_cpus)))
            for rank in range(config.num_actors)]


class RolloutManager(EngineWeights):
    """Owns the engine actors, the teacher actors, the dataset cursor and the reward
    function."""

    def __init__(self, config: RolloutConfig, model_path: str, seed: int | None = None, *,
                 engines: list[Any], teachers: list[Any], reward_actors: dict[str, list[Any]],
                 owns_engines: bool = False, samples_per_step: int = 8,
                 estimator_in_driver: bool = False) -> None:
        """The manager is handed its actors and starts none (services/runtime/gang.py
        starts every actor of a program). ``engines``: actors that answer the engine verbs
        (engines, or the trainer ranks of the colocated fast path); the manager stops them
        in ``shutdown`` only when ``owns_engines``. ``teachers``: the teacher actors of
        ``config.distillation`` (one at least when there is a teacher). ``reward_actors``:
        the reward models' and judges' actors by part name. ``samples_per_step``: how many
        of a rollout's samples it hands on as text (samples.jsonl).
        ``estimator_in_driver``: the driver applies an estimator that reads the rewards,
        since its inputs need the trainer's actors (the KL in the reward); the manager
        still adds a teacher's term."""
        check_engine_available(config)
        self.config = config
        self.seed = config.seed if seed is None else seed
        tokenizer_path = config.tokenizer or model_path
        self.tokenizer = load_tokenizer(tokenizer_path)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
        self.apply_chat_template = (config.apply_chat_template
                                    if config.apply_chat_template is not None
                                    else self.tokenizer.chat_template is not None)
        self.context = model_context(model_path)
        self.max_prompt_tokens = prompt_budget(config, self.context)  # raises if ≤ 0
        self.records: list[PromptRecord] = load_prompt_dataset(config.dataset)
        self.cursor = PromptCursor(len(self.records), config.dataset.seed, config.dataset.shuffle)
        self.samples_per_step = samples_per_step
        self.reward_actors = reward_actors
        self.rewarder = Rewarder(config.reward_parts, reward_actors)
        self.turns: TurnFormat | None = None
        if config.environment is not None:  # its class imports here, or the job stops
            load_environment_class(config.environment.class_path)
            self.turns = TurnFormat(self.tokenizer, self.apply_chat_template,
                                    config.environment.observation_role)
        self.next_group_index = 0
        self.weight_version = 0
        self._eval_records: dict[str, list[PromptRecord]] = {}  # held-out sets, loaded once
        self._encoded: dict[int, tuple[int, list[int] | None]] = {}
        """Record index -> (its prompt's full length, the ids it trains on; None: dropped)."""
        self.owns_engines = owns_engines
        self.pool = EnginePool(engines, elastic=owns_engines,
                               timeout_s=config.generate_timeout_s or config.call_timeout_s / 2)
        """The engines by rank; a lost one's calls go to the others (rollout/engine_pool.py).
        Trainer ranks serving as engines (``owns_engines`` False) are never taken for
        lost: their loss restarts the job."""
        self.partial = (PartialRollouts(
            config.n_samples_per_prompt, config.sampling.max_new_tokens, config.chunk_tokens,
            (1 + config.async_steps) * config.num_prompts_per_rollout,
            config.staleness_bound) if config.partial_rollout else None)
        """The samples in flight across steps (rollout.partial_rollout; rollout/partial.py)."""
        self.teacher = config.distillation
        self.estimator = build_estimator(config.advantage)  # a user's class imports here
        if estimator_in_driver and self.estimator.needs_teacher and self.estimator.uses_rewards:
            raise ValueError(
                f"trainer.loss.kl_placement: {type(self.estimator).__name__} reads the "
                "rewards and a teacher's log-probs, which only the manager holds, while the "
                "driver puts the KL in the rewards; use trainer.loss.kl_placement: loss")
        self.estimator_in_driver = (self.estimator.needs_critic or (
            estimator_in_driver and self.estimator.uses_rewards))
        """The driver applies the estimator (the critic's values, the KL in the reward)."""
        self.teachers: list[Any] = list(teachers)
        """Empty where nothing here trains (an evaluation, ``tally eval``)."""
        try:  # past the timeout the manager fails to start: a fault, retried by the driver
            ray.get([actor.ping.remote() for actor in [*self.engines, *self.teachers,
                                                       *self._reward_actor_list()]],
                    timeout=config.call_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"rollout ping took longer than rollout.call_timeout_s="
                               f"{config.call_timeout_s:g} s (the manager's start-up: its "
                               "engines, teachers and reward actors did not all answer)"
                               ) from None

    # -- one step ---------------------------------------------------------------------

    def generate_batch(self, step: int) -> RolloutBatch:
        """The rollout's RolloutBatch: rollout_batch_size prompts × G samples, whole groups
        (dynamic sampling fills all of it)."""
        gen_start_time = time.time()  # wall clock: the driver compares it with training's
        num_prompts = self.config.num_prompts_per_rollout
        dynamic = self.config.dynamic_sampling
        stats = StepStats()
        kept: list[Group] = []
        zero_spread: list[Group] = []
        partial_metrics: dict[str, float] = {}
        for draw in range(dynamic.max_draws if dynamic.enabled else 1):
            if len(kept) == num_prompts:
                break
            if self.partial is not None:  # the first groups done, from the pool in flight
                groups, partial_metrics = self._take_partial(num_prompts - len(kept), step,
                                                             draw, stats, partial_metrics)
            else:
                groups = self._play(self._take_prompts(num_prompts - len(kept), stats), step,
                                    draw, stats)
            if dynamic.enabled:
                spread, flat = split_by_spread([[s.reward for s in g.samples if s.scored]
                                                for g in groups])
                kept += [groups[i] for i in spread]
                zero_spread += [groups[i] for i in flat]
            else:
                kept += groups
        num_filled = num_prompts - len(kept)
        kept += zero_spread[:num_filled]  # max_draws hit: see rollout/dynamic_sampling.py
        if self.partial is not None:
            partial_metrics |= step_metrics([s.generation for g in kept for s in g.samples],
                                            step)
        own_metrics, events = self.rollout.finish(stats, step)  # raises past its limits
        lost = self.pool.take_events()  # engines lost since the last batch (an eval's too)
        events = [*events, *lost]
        metadata = {
            "rollout/engines_lost": float(len(lost)),
            **own_metrics,
            "rollout/num_draws": float(stats.num_draws),
            "rollout/zero_spread_groups": float(len(zero_spread)),
            "rollout/zero_spread_filled": float(num_filled),
            "rollout/generated_samples": float(stats.num_samples),
            "rollout/generated_reward_mean": stats.reward_mean,
            "rollout/gen_tokens": float(stats.gen_tokens),
            "rollout/gen_time_s": stats.gen_time_s,
            "rollout/gen_tokens_per_s": stats.gen_tokens / max(stats.gen_time_s, 1e-9),
            "rollout/reward_errors": float(sum(n for n, _ in stats.errors.values())),
            "perf/reward_s": stats.reward_s,
            "perf/reward_busy_s": stats.reward_busy_s,
            **{name: float(count) for name, count in stats.reward_counts.items()},
            "rollout/prompts_truncated": float(stats.prompts_truncated),
            "rollout/prompts_dropped": float(stats.prompts_dropped),
            "rollout/weight_version": float(self.weight_version),
            "rollout/epoch": float(self.cursor.epoch),
            "rollout/gen_start_time": gen_start_time,
            "rollout/gen_end_time": time.time(),
            **partial_metrics,
        }
        return self._build_batch(kept, metadata, events, step)

    def _take_partial(self, num_groups: int, step: int, draw: int, stats: StepStats,
                      metrics: dict[str, float]) -> tuple[list[Group], dict[str, float]]:
        """The first ``num_groups`` groups of the pool in flight to finish
        (rollout/partial.py), scored; ``draw``: dynamic sampling's take within the step
        (the first drops the groups past rollout.max_staleness)."""
        assert self.partial is not None and isinstance(self.rollout, SingleTurn)
        started = time.perf_counter()
        call = PartialStats()
        stale = self.partial.drop_stale(step) if draw == 0 else 0
        chunk = self.config.sampling.model_copy(
            update={"max_new_tokens": self.config.chunk_tokens})

        def decode(contexts: list[list[int]], round_number: int) -> list[Generation]:
            version = self.weight_version  # a load queues behind this call: one version
            # seeds from (seed, step, round, rank): every round of the run its own
            generations = self._generate(contexts, chunk, step, round_number,
                                         EpisodeTurn(PARTIAL_EPISODES, round_number,
                                                     last=False))
            return [dataclasses.replace(g, versions=[version] * len(g.token_ids))
                    for g in generations]

        taken = self.partial.take(num_groups,
                                  lambda count: self._take_prompts(count, stats), decode, call,
                                  call_start=draw == 0)
        requests = [Request(self.records[g.record], g.prompt_ids, g.record)
                    for g in taken for _ in g.samples]
        played = self.rollout.score(requests, [s.generation() for g in taken
                                               for s in g.samples])
        played.gen_time_s = time.perf_counter() - started - played.reward_s
        stats.add(played)
        stats.gen_tokens += call.decoded_tokens - sum(s.policy_tokens for s in played.samples)
        return groups_of(played.samples, self.config.n_samples_per_prompt), {
            "rollout/stale_dropped": metrics.get("rollout/stale_dropped", 0.0) + stale,
            "rollout/partial_rounds": metrics.get("rollout/partial_rounds", 0.0) + call.rounds,
            "rollout/in_flight_groups": float(len(self.partial.groups)),
        }

    def _seed(self, step: int | str, draw: int, rank: int) -> int:
        digest = hashlib.sha256(f"{self.seed}:{step}:{draw}:{rank}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & (2**63 - 1)

    def _encode(self, record: PromptRecord, where: str) -> list[int] | None:
        """The record's prompt ids within rollout.max_prompt_tokens (and the context left
        after max_new_tokens), by rollout.prompt_truncation; None: dropped."""
        ids = encode_prompt(self.tokenizer, record.prompt, self.apply_chat_template)
        return fit_prompt(ids, self.max_prompt_tokens, self.config.prompt_truncation, where)

    def _take_prompts(self, count: int, stats: StepStats
                      ) -> list[tuple[int, list[int]]]:
        """The next ``count`` records from the cursor with their prompt ids; a dropped
        prompt is replaced by the next one (a whole epoch of drops is an error)."""
        if self.rollout.writes_prompts:  # an environment writes each episode's prompt
            return [(index, []) for index in self.cursor.take(count)]
        taken: list[tuple[int, list[int]]] = []
        while len(taken) < count:
            indices = self.cursor.take(count - len(taken))
            fresh = self._encode_records([i for i in indices if i not in self._encoded])
            for index in indices:
                encoded = self._encoded.get(index) or fresh[index]
                full_length, ids = encoded
                if ids is None:
                    stats.prompts_dropped += 1
                    if stats.prompts_dropped > len(self.records):
                        raise PromptTooLong(
                            f"rollout.max_prompt_tokens: every prompt is longer than "
                            f"{self.max_prompt_tokens} tokens; nothing is left to train on")
                    continue
                stats.prompts_truncated += len(ids) < full_length
                taken.append((index, ids))
        return taken

    def _encode_records(self, indices: list[int]
                        ) -> dict[int, tuple[int, list[int] | None]]:
        """Record index -> (its prompt's full length, the ids it trains on; None: dropped),
        encoded in one batch and kept (a record's ids never change: encoded once each)."""
        fulls = encode_prompts(self.tokenizer, [self.records[i].prompt for i in indices],
                               self.apply_chat_template)
        encoded = {index: (len(full), fit_prompt(full, self.max_prompt_tokens,
                                                 self.config.prompt_truncation,
                                                 f"record {index}"))
                   for index, full in zip(indices, fulls, strict=True)}
        for index, value in encoded.items():
            if len(self._encoded) < ENCODED_PROMPTS:
                self._encoded[index] = value
        return encoded

    @functools.cached_property
    def rollout(self) -> Rollout:
        """How this job plays its samples, for training and evaluation alike: an
        environment's episodes, or single-turn responses scored by rollout.reward."""
        return build_rollout(self.config, self.rewarder, self.turns, self.tokenizer,
                             self.max_prompt_tokens, self.context, self._generate,
                             self._shards_as_done)

    def _play(self, taken: list[tuple[int, list[int]]], step: int, draw: int,
              stats: StepStats) -> list[Group]:
        """G scored samples of each of the given records, one group each."""
        group_size = self.config.n_samples_per_prompt
        requests = [Request(self.records[i], ids, i) for i, ids in taken
                    for _ in range(group_size)]
        played = self.rollout.play([Play(requests, self.config.sampling, step, draw)],
                                   training=True)
        stats.add(played)
        return groups_of(played.samples, group_size)

    def _build_batch(self, groups: list[Group], metadata: dict[str, float],
                     events: list[tuple[str, str]], step: int) -> RolloutBatch:
        """The step's batch (rollout/rollouts/step.py) with its advantages; the group
        indices it used are taken."""
        first = self.next_group_index
        records = training_records(groups, first, step, self.samples_per_step,
                                   self.tokenizer, seed=self.seed)
        batch = build_batch(groups, first, self.config.n_samples_per_prompt,
                            self.pad_token_id, metadata, events, records)
        self.next_group_index += len(groups)
        return self._with_advantages(batch)

    def _with_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        """The estimator's advantages (none yet when it needs the critic's values: the
        driver's), and a rollout.teacher's reverse-KL term: on top of them, or with
        ``placement: reward`` in the token rewards the estimator reads (GAE's, in the
        driver: rollout/teacher_reward.py)."""
        if self.teacher is None:
            return batch if self.estimator_in_driver else self.estimator.apply(batch)
        teacher, metadata = self._teacher_log_probs(batch)
        batch = dataclasses.replace(batch, metadata={**batch.metadata, **metadata})
        if self.estimator.needs_teacher:  # the teacher's term is the estimator's own
            return self.estimator.apply(batch, teacher_log_probs=teacher)
        if self.teacher.placement == "reward":
            batch = with_teacher_in_rewards(batch, teacher, self.teacher.coef)
            return batch if self.estimator_in_driver else self.estimator.apply(batch)
        if not self.estimator_in_driver:
            batch = self.estimator.apply(batch)
        return Distill(self.teacher.coef).apply(batch, teacher_log_probs=teacher)

    def _teacher_log_probs(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The teachers' log-probs [N, S] of the sampled tokens (they score their shares
        at once), with ``distill/reverse_kl`` and ``perf/teacher_s``."""
        assert self.teacher is not None
        started = time.perf_counter()
        if not self.teachers:
            raise RuntimeError("rollout.distillation names a teacher but this manager was "
                               "handed no teacher actor (services/runtime/gang.py starts them)")
        shares = shard_bounds(batch.num_samples, len(self.teachers))
        temperature = self.config.sampling.temperature
        refs = [teacher.log_probs.remote(batch.input_ids[a:b], batch.prompt_lengths[a:b],
                                         batch.response_lengths[a:b], temperature)
                for teacher, (a, b) in zip(self.teachers, shares, strict=True) if b > a]
        teacher = torch.cat([from_wire(part) for part in ray.get(refs)])
        return teacher, {
            "distill/reverse_kl": reverse_kl(teacher, batch.rollout_log_probs, batch.loss_mask),
            "perf/teacher_s": time.perf_counter() - started}

    # -- evaluation -------------------------------------------------------------------

    def evaluate(self, dataset: DatasetConfig, num_prompts: int | None, num_samples: int,
                 temperature: float, step: int) -> EvalRun:
        """Greedy and sampled responses to held-out prompts on the engines, scored as in
        training, with the weight version they came from (rollout/rollouts/
        evaluation.py). Nothing of the training state changes, so training's stream and
        a resume stay exact."""
        key = dataset.model_dump_json()
        if key not in self._eval_records:
            self._eval_records[key] = load_prompt_dataset(dataset)
        greedy = self.config.sampling.model_copy(update={"temperature": 0.0})
        sampled = self.config.sampling.model_copy(update={"temperature": temperature})
        return evaluate(self.rollout, self._eval_requests(self._eval_records[key][:num_prompts]),
                        num_samples, greedy, sampled, step, self.weight_version,
                        self.tokenizer)

    def _eval_requests(self, records: list[PromptRecord]) -> list[Request]:
        """Held-out records as requests with their prompt ids (one over its budget cut or
        dropped by rollout.prompt_truncation), unless the rollout writes its own."""
        if self.rollout.writes_prompts:
            return [Request(r, [], i) for i, r in enumerate(records)]
        fitted = [(i, r, self._encode(r, f"held-out record {i}")) for i, r in enumerate(records)]
        return [Request(r, ids, i) for i, r, ids in fitted if ids is not None]

    def _generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                  step: int | str, draw: int = 0, turn: EpisodeTurn | None = None
                  ) -> list[Generation]:
        """Responses to ``prompts`` sharded over the engines, in prompt order (``turn``:
        they are episodes' contexts, see rollout/engines/base.EpisodeTurn)."""
        shards = dict(self._shards_as_done(prompts, sampling, step, draw, turn))
        return [g for bounds in sorted(shards) for g in shards[bounds]]

    def _shards_as_done(self, prompts: list[list[int]], sampling: SamplingConfig,
                        step: int | str, draw: int, turn: EpisodeTurn | None = None
                        ) -> Iterator[tuple[tuple[int, int], list[Generation]]]:
        """Each engine's generate call on its shard of ``prompts``, as it finishes, with
        its bounds (a generator: the caller scores one while the other engines still
        generate). Shard r always has rank r's slice and seed, whichever engine plays it:
        a lost engine's shard re-run elsewhere gives the samples it would have."""
        extra = {} if turn is None else {"turn": turn}

        def call(start: int, end: int, seed: int) -> Any:
            return lambda engine: engine.generate.remote(prompts[start:end], sampling, seed,
                                                         **extra)

        shards = [Shard(rank, (start, end), call(start, end, self._seed(step, draw, rank)))
                  for rank, (start, end) in enumerate(shard_bounds(len(prompts),
                                                                   len(self.engines)))
                  if end > start]
        for shard, generations in self.pool.as_done(shards):
            yield shard.bounds, generations

    # -- the engine pool --------------------------------------------------------------

    @property
    def engines(self) -> list[Any]:
        """The engine actors by rank (a lost one's place held until it is replaced)."""
        return self.pool.engines

    @ray.method(concurrency_group="health")
    def lost_engines(self) -> list[tuple[int, str]]:
        """(rank, actor id) of each engine lost and not yet replaced; answered at once,
        beside a rollout in progress (its own concurrency group), so the driver can have
        the gang start a replacement while the manager generates."""
        return self.pool.lost()

    def replace_engine(self, rank: int, engine: Any) -> int:
        """``engine`` (the gang's, in lost rank ``rank``'s bundle) loads the weights the
        others serve and takes its rank's shards again; returns the weight version."""
        self.pool.replace(rank, engine, self.config.call_timeout_s)
        return self.weight_version

    def plant(self, planted: frozenset[str]) -> None:
        """A verifier's planted errors for the pool in flight (rollout/partial.py); a
        verify-only verb, as ``TrainerRank.plant``: production never calls it."""
        if self.partial is None:
            raise ValueError("plant: this manager has no partial rollouts to plant in")
        self.partial.planted = frozenset(planted)

    # -- state, lifetime (the weight verbs: rollout/engine_weights.py) -----------------

    def ping(self) -> int:
        return self.weight_version

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs (sampling seeds are derived from seed and step)."""
        return {
            "cursor": self.cursor.state_dict(),
            "next_group_index": self.next_group_index,
            "weight_version": self.weight_version,
            "seed": self.seed,
            "rewards": self.rewarder.state_dict(),
            **({"partial": self.partial.state_dict()} if self.partial is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(
                f"seed: checkpoint was written with seed {state['seed']}, this run has "
                f"{self.seed}; an exact resume needs the same seed"
            )
        self.cursor.load_state_dict(state["cursor"])
        self.next_group_index = int(state["next_group_index"])
        self.weight_version = int(state["weight_version"])
        self.rewarder.load_state_dict(state.get("rewards", {}))
        if self.partial is not None:  # a checkpoint of a run without: nothing in flight
            self.partial.load_state_dict(state.get("partial", {
                "next_admission": 0, "rounds": 0, "groups": []}))

    def _reward_actor_list(self) -> list[Any]:
        return [actor for actors in self.reward_actors.values() for actor in actors]

    def engine_nodes(self) -> list[str]:
        """The Ray node id of each engine actor, in engine order."""
        return ray.get([engine.node_id.remote() for engine in self.engines],
                       timeout=self.config.call_timeout_s)

    def shutdown(self) -> None:
        """Stop the teachers, and the engines (and any servers they launched) if they
        are ours."""
        for actor in [*self.teachers, *self._reward_actor_list()]:
            ray.kill(actor)
        self.teachers, self.reward_actors = [], {}
        engines, self.pool.engines = self.engines, []
        if not self.owns_engines:
            return
        lost = {rank for rank, _ in self.pool.lost()}
        live = [engine for rank, engine in enumerate(engines) if rank not in lost]
        ray.get([engine.shutdown.remote() for engine in live],
                timeout=self.config.call_timeout_s)
        for engine in engines:
            ray.kill(engine)



RolloutManagerActor = ray.remote(num_cpus=0, concurrency_groups={"health": 1})(RolloutManager)
"""RolloutManager as a Ray actor class: ``RolloutManagerActor.remote(config, path)``."""
