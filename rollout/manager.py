"""RolloutManager: prompts in, one RolloutBatch per step out.

    dataset ─► PromptCursor ─► P prompts × G ─► shards ─► engine actors (torch | sglang)
                                                               │ token ids + log-probs
    RolloutBatch ◄─ advantages ◄─ [dynamic sampling] ◄─ rewards ◄┘ (decoded, in prompt order)
         ▲  the estimator (rollout/advantages/) ◄─ teacher log-probs, when it or
            rollout.teacher needs them (distillation)

One step draws P = N / G prompts, samples G responses for each (a group), scores them
and calls the advantage estimator over the final batch, unless it needs the critic's
values (the driver calls it then); a ``rollout.teacher`` beside it adds its per-token
reverse-KL advantage (rollout/teacher.py). Group indices are contiguous and keep
increasing across steps. Sampling seeds are a hash of (seed, step, round, engine rank):
the only mutable state is the data cursor, the next group index and the weight version,
which is what :meth:`state_dict` saves, so a resumed run continues exactly.

Use it as a Ray actor (:data:`RolloutManagerActor`, returned batches travel through the
object store), or in-process inside a Ray driver.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from rollout.advantages import Distill, build_estimator, reverse_kl
from rollout.batch import RolloutBatch, from_wire
from rollout.config import DatasetConfig, RolloutConfig, SamplingConfig, TeacherConfig
from rollout.cursor import PromptCursor
from rollout.datasets import PromptRecord, load_prompt_dataset
from rollout.dynamic_sampling import split_by_spread
from rollout.engine_weights import EngineWeights
from rollout.engines import check_engine_available, engine_actor_options, engine_class
from rollout.engines.base import EpisodeTurn, Generation
from rollout.environments import load_environment_class
from rollout.episodes import EnvironmentFailures, Episode, run_episodes
from rollout.prompts import PromptTooLong, fit_prompt
from rollout.reward_parts import Rewarder, RewardScores, start_reward_actors
from rollout.shards import shard_bounds
from rollout.teacher import Teacher
from rollout.token_budget import model_context, prompt_budget
from rollout.tokenizer import decode_responses, encode_prompt, encode_prompts, load_tokenizer
from rollout.turns import TurnFormat

ENCODED_PROMPTS = 65536
"""Records whose prompt ids the manager keeps (a small dataset's every record; a big one
is encoded as drawn, its ids never all held)."""


@dataclass
class _Group:
    """One record's G scored samples: one prompt and its responses, or G episodes of an
    environment (each with its own first observation and holes in its loss mask)."""

    prompt_ids: list[list[int]]
    generations: list[Generation]
    rewards: list[float]
    masks: list[list[int]] | None = None
    """Per response token: 1 the policy's, 0 the environment's; None: all the policy's."""
    turn_rewards: list[list[tuple[int, float]]] | None = None
    """Per episode: (response position, reward) of each environment step, on the last
    token of its action (GAE's per-turn credit); None: one reward per response."""
    parts: dict[str, list[float]] = field(default_factory=dict)
    """Each reward part's values of the G samples (rollout.reward)."""
    texts: list[str] = field(default_factory=list)
    """The G responses as the rewards read them."""
    label: str | None = None
    record_prompt: Any = None
    """The record's prompt as the dataset holds it (a string or chat messages)."""


@dataclass(frozen=True)
class EvalOutcome:
    """One held-out prompt's evaluation: the greedy response's reward and length, and the
    rewards of its sampled responses (for pass@k)."""

    metadata: dict[str, Any]
    greedy_reward: float
    greedy_length: int
    sample_rewards: list[float]
    samples: list[dict[str, Any]] = field(default_factory=list)
    """samples.jsonl records of its responses, the greedy one first."""


@dataclass(frozen=True)
class EvalRun:
    """One evaluation: the weight version the engines held and each prompt's outcome."""

    weight_version: int
    outcomes: list[EvalOutcome]


@dataclass
class _StepStats:
    num_draws: int = 0
    num_samples: int = 0
    gen_tokens: int = 0
    gen_time_s: float = 0.0
    all_rewards: list[float] = field(default_factory=list)
    prompts_truncated: int = 0
    prompts_dropped: int = 0
    episodes: list[Episode] = field(default_factory=list)
    env_seconds: float = 0.0
    reward_s: float = 0.0
    """Seconds the rollout waited for rewards after its last response was generated."""
    reward_busy_s: float = 0.0
    reward_counts: dict[str, int] = field(default_factory=dict)
    """``reward/<name>/<key>`` -> count over the rollout's draws (a judge's unparsed)."""
    errors: dict[str, tuple[int, str | None]] = field(default_factory=dict)

    def add_scores(self, scores: RewardScores) -> None:
        self.reward_busy_s += scores.busy_s
        for name, count in scores.counts.items():
            self.reward_counts[name] = self.reward_counts.get(name, 0) + count
        for name, (count, first) in scores.errors.items():
            had, first_had = self.errors.get(name, (0, None))
            self.errors[name] = (had + count, first_had or first)


def start_engines(config: RolloutConfig, model_path: str,
                  engine_placement: list[dict[str, Any]] | None = None) -> list[Any]:
    """The engine actors of ``config.engine``, started (not waited for). A driver calls
    this itself, beside the manager's own start, when it can: an actor's process start
    and imports take seconds, and the manager's would otherwise come first."""
    actor_class = ray.remote(engine_class(config.engine))
    placement = engine_placement or [{} for _ in range(config.engine.num_engines)]
    tokenizer_path = config.tokenizer or model_path
    return [actor_class.options(**{**engine_actor_options(config.engine), **placement[rank]})
            .remote(config.engine, model_path, tokenizer_path, rank)
            for rank in range(config.engine.num_engines)]


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

    def __init__(self, config: RolloutConfig, model_path: str, seed: int | None = None,
                 engine_placement: list[dict[str, Any]] | None = None,
                 engines: list[Any] | None = None, owns_engines: bool | None = None,
                 teachers: list[Any] | None = None,
                 reward_actors: dict[str, list[Any]] | None = None,
                 samples_per_step: int = 8) -> None:
        """engine_placement: per-engine Ray options (e.g. a placement-group bundle) chosen
        by the driver, which knows the whole job's layout; they override the defaults.
        ``engines``: actors that answer the engine verbs, started by the caller (the
        trainer ranks of the colocated fast path, or :func:`start_engines` run beside
        this actor's own start); the manager starts none, and stops them only when
        ``owns_engines`` (default: only the engines it started). ``teachers``: the
        teacher actors of ``config.distillation`` (:func:`start_teachers`, placed by the
        driver), which the manager stops; None: it starts its own with its first rollout
        when there is a teacher. ``reward_actors``: the reward models' and judges' actors
        by part name (rollout/reward_parts.start_reward_actors, placed by the driver),
        which the manager stops; None: it starts its own. ``samples_per_step``: how many
        of a rollout's samples it hands on as text (samples.jsonl)."""
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
        if reward_actors is None:
            from rollout.tiny import resolve_model_path

            reward_actors = start_reward_actors(config.reward_parts, resolve_model_path)
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
        self.owns_engines = engines is None if owns_engines is None else owns_engines
        if engines is None:
            engines = start_engines(config, model_path, engine_placement)
        self.engines = engines
        self.teacher = config.distillation
        self.estimator = build_estimator(config.advantage)  # a user's class imports here
        self.teachers: list[Any] = list(teachers or [])
        """The driver's, or the manager's own started with its first rollout (an
        evaluation or ``tally eval`` needs none)."""
        ray.get([actor.ping.remote() for actor in [*self.engines, *self.teachers,
                                                   *self._reward_actor_list()]])

    # -- one step ---------------------------------------------------------------------

    def generate_batch(self, step: int) -> RolloutBatch:
        """The rollout's RolloutBatch: rollout_batch_size prompts × G samples, whole groups
        (dynamic sampling fills all of it)."""
        gen_start_time = time.time()  # wall clock: the driver compares it with training's
        num_prompts = self.config.num_prompts_per_rollout
        dynamic = self.config.dynamic_sampling
        stats = _StepStats()
        kept: list[_Group] = []
        zero_spread: list[_Group] = []
        play = self._episode_round if self.turns is not None else self._rollout_round
        for draw in range(dynamic.max_draws if dynamic.enabled else 1):
            if len(kept) == num_prompts:
                break
            groups = play(self._take_prompts(num_prompts - len(kept), stats), step, draw,
                          stats)
            if dynamic.enabled:
                spread, flat = split_by_spread([g.rewards for g in groups])
                kept += [groups[i] for i in spread]
                zero_spread += [groups[i] for i in flat]
            else:
                kept += groups
        num_filled = num_prompts - len(kept)
        kept += zero_spread[:num_filled]  # max_draws hit: see rollout/dynamic_sampling.py
        if self.turns is None:  # an environment's episodes are scored by it, not the parts
            self.rewarder.check_errors(stats.errors, stats.num_samples, step)
        events = self._environment_events(stats, step)
        metadata = {
            **self._environment_metrics(stats),
            "rollout/num_draws": float(stats.num_draws),
            "rollout/zero_spread_groups": float(len(zero_spread)),
            "rollout/zero_spread_filled": float(num_filled),
            "rollout/generated_samples": float(stats.num_samples),
            "rollout/generated_reward_mean": _mean(stats.all_rewards),
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
        }
        return self._build_batch(kept, metadata, events, step)

    def _seed(self, step: int | str, draw: int, rank: int) -> int:
        digest = hashlib.sha256(f"{self.seed}:{step}:{draw}:{rank}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & (2**63 - 1)

    def _encode(self, record: PromptRecord, where: str) -> list[int] | None:
        """The record's prompt ids within rollout.max_prompt_tokens (and the context left
        after max_new_tokens), by rollout.prompt_truncation; None: dropped."""
        ids = encode_prompt(self.tokenizer, record.prompt, self.apply_chat_template)
        return fit_prompt(ids, self.max_prompt_tokens, self.config.prompt_truncation, where)

    def _take_prompts(self, count: int, stats: _StepStats
                      ) -> list[tuple[int, list[int]]]:
        """The next ``count`` records from the cursor with their prompt ids; a dropped
        prompt is replaced by the next one (a whole epoch of drops is an error)."""
        if self.turns is not None:  # an environment writes each episode's prompt
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

    def _rollout_round(
        self, taken: list[tuple[int, list[int]]], step: int, draw: int, stats: _StepStats
    ) -> list[_Group]:
        """Generate and score G responses for each of the given records."""
        group_size = self.config.n_samples_per_prompt
        records = [self.records[i] for i, _ in taken]
        prompt_ids = [ids for _, ids in taken]
        sample_prompts = [ids for ids in prompt_ids for _ in range(group_size)]
        policy_prompts = [self.tokenizer.decode(ids, skip_special_tokens=False)
                          for ids in prompt_ids]  # the prompt as the policy saw it
        each = [j for j in range(len(records)) for _ in range(group_size)]
        raw = [records[j].prompt for j in each]
        labels = [records[j].label for j in each]
        metadata = [records[j].metadata for j in each]
        started = time.perf_counter()
        generations: list[Generation] = []
        texts: list[str] = []
        pending = []  # each engine's shard is scored as soon as it is generated
        for (a, b), shard in self._shards_as_done(sample_prompts, self.config.sampling,
                                                  step, draw):
            shard_texts = decode_responses(self.tokenizer, [g.token_ids for g in shard])
            pending.append((a, shard, shard_texts, self.rewarder.submit(
                [policy_prompts[j] for j in each[a:b]], raw[a:b], shard_texts, labels[a:b],
                metadata[a:b])))
        generated = time.perf_counter()
        stats.gen_time_s += generated - started
        pending.sort(key=lambda shard: shard[0])
        for _, shard, shard_texts, _ in pending:
            generations += shard
            texts += shard_texts
        scores = self.rewarder.collect([p for *_, p in pending])
        stats.reward_s += time.perf_counter() - generated
        stats.add_scores(scores)
        stats.gen_tokens += sum(len(g.token_ids) for g in generations)
        stats.num_draws += 1
        stats.num_samples += len(generations)
        stats.all_rewards += scores.total
        rows = [slice(j * group_size, (j + 1) * group_size) for j in range(len(records))]
        return [_Group([prompt_ids[j]] * group_size, generations[rows[j]],
                       scores.total[rows[j]], parts={k: v[rows[j]] for k, v in
                                                     scores.parts.items()},
                       texts=texts[rows[j]], label=records[j].label,
                       record_prompt=records[j].prompt)
                for j in range(len(records))]

    def _episode_round(self, taken: list[tuple[int, list[int]]], step: int, draw: int,
                       stats: _StepStats) -> list[_Group]:
        """G episodes of the environment for each of the given records."""
        group_size = self.config.n_samples_per_prompt
        indices = [i for i, _ in taken for _ in range(group_size)]
        started = time.perf_counter()
        episodes, env_seconds = self._play([self.records[i] for i in indices], indices,
                                           self.config.sampling, step, draw)
        stats.gen_time_s += time.perf_counter() - started - env_seconds
        stats.env_seconds += env_seconds
        stats.gen_tokens += sum(e.policy_tokens for e in episodes)
        stats.num_draws += 1
        stats.num_samples += len(episodes)
        stats.episodes += episodes
        stats.all_rewards += [e.reward for e in episodes]
        return [
            _Group([e.prompt_ids for e in group], [e.generation() for e in group],
                   [e.reward for e in group], [e.response_mask for e in group],
                   [e.turn_rewards for e in group],
                   texts=decode_responses(self.tokenizer, [e.response_ids for e in group]),
                   label=self.records[indices[j]].label,
                   record_prompt=self.records[indices[j]].prompt)
            for j, group in ((j, episodes[j:j + group_size])
                             for j in range(0, len(episodes), group_size))
        ]

    def _play(self, records: list[PromptRecord], indices: list[int],
              sampling: SamplingConfig, step: int | str, draw: int = 0
              ) -> tuple[list[Episode], float]:
        """One episode per record on the engines, every live one generating each turn."""
        assert self.turns is not None and self.config.environment is not None

        def generate(contexts: list[list[int]], max_new_tokens: int, turn: int
                     ) -> list[Generation]:
            turn_sampling = sampling.model_copy(update={"max_new_tokens": max_new_tokens})
            episode_turn = EpisodeTurn(f"{step}:{draw}", turn,
                                       turn + 1 == self.config.environment.max_turns)
            return self._generate(contexts, turn_sampling,
                                  step if turn == 0 else f"{step}:turn{turn}", draw,
                                  episode_turn)

        def fit(ids: list[int], i: int) -> list[int]:
            fitted = fit_prompt(ids, self.max_prompt_tokens, self.config.prompt_truncation,
                                f"the first observation of record {indices[i]}")
            assert fitted is not None  # "drop" is refused with an environment
            return fitted

        return run_episodes(
            [{"prompt": r.prompt, "label": r.label, "metadata": dict(r.metadata)}
             for r in records],
            self.config.environment, self.turns, generate, sampling.max_new_tokens, fit,
            self.context)

    def _environment_events(self, stats: _StepStats, step: int) -> list[tuple[str, str]]:
        """One ``environment_failed`` event per failed episode; past
        max_failures_per_rollout, EnvironmentFailures (the job stops with it)."""
        environment = self.config.environment
        if environment is None:
            return []
        failed = [e.failure for e in stats.episodes if e.failure is not None]
        if len(failed) > environment.max_failures_per_rollout:
            raise EnvironmentFailures(
                f"rollout.environment.max_failures_per_rollout: {len(failed)} episodes of "
                f"rollout step {step} failed in {environment.class_path}, above "
                f"{environment.max_failures_per_rollout}; first: {failed[0]}")
        return [("environment_failed", f"rollout step {step}: {environment.class_path}: "
                 f"{failure}; the episode ends with reward 0") for failure in failed]

    def _environment_metrics(self, stats: _StepStats) -> dict[str, float]:
        """Per episode: turns, observations read and, where the environment counts them
        (a ``tool_calls`` attribute), tool calls; per rollout: the seconds spent in the
        environment, failures, and the policy's share of the response tokens."""
        if not stats.episodes:
            return {}
        episodes = stats.episodes
        response_tokens = sum(len(e.response_ids) for e in episodes)
        counted = [e.tool_calls for e in episodes if e.tool_calls is not None]
        return {
            **({"env/tool_calls_mean": _mean(counted)} if counted else {}),
            "env/turns_mean": _mean([e.turns for e in episodes]),
            "env/observations_mean": _mean([e.observations for e in episodes]),
            "env/seconds": stats.env_seconds,
            "env/failures": float(sum(e.failure is not None for e in episodes)),
            "env/done_fraction": _mean([e.env_done for e in episodes]),
            "env/policy_token_share": (sum(e.policy_tokens for e in episodes)
                                       / max(response_tokens, 1)),
        }

    def _build_batch(self, groups: list[_Group], metadata: dict[str, float],
                     events: list[tuple[str, str]] | None = None, step: int = 0
                     ) -> RolloutBatch:
        group_size = self.config.n_samples_per_prompt
        group_index = [
            self.next_group_index + j for j, g in enumerate(groups) for _ in g.generations
        ]
        generations = [gen for g in groups for gen in g.generations]
        rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
        lengths = [len(gen.token_ids) for gen in generations]
        metadata = {
            **metadata,
            "rollout/reward_mean": float(rewards.mean()),
            "rollout/reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "rollout/response_length_mean": _mean(lengths),
            "rollout/response_length_max": float(max(lengths)),
            "rollout/truncated_fraction": _mean(
                [gen.finish_reason == "length" for gen in generations]
            ),
            **_part_metrics(groups),
        }
        masks = ([m for g in groups for m in g.masks or []] if self.turns is not None
                 else None)  # episodes' holes; else every response token counts
        turn_rewards = ([t for g in groups for t in g.turn_rewards or []]
                        if self.turns is not None else None)
        batch = RolloutBatch.from_samples(
            prompt_ids=[p for g in groups for p in g.prompt_ids],
            response_ids=[gen.token_ids for gen in generations],
            response_log_probs=[gen.log_probs for gen in generations],
            rewards=rewards.tolist(),
            advantages=[0.0] * len(generations),  # the estimator's, added below
            group_index=group_index,
            samples_per_prompt=group_size,
            pad_token_id=self.pad_token_id,
            response_masks=masks,
            metadata=metadata,
            events=events,
            turn_rewards=turn_rewards,
            samples=self._sample_records(groups, group_index, step),
        )
        self.next_group_index += len(groups)
        return self._with_advantages(batch)

    def _sample_records(self, groups: list[_Group], group_index: list[int], step: int
                        ) -> list[dict[str, Any]]:
        """samples.jsonl records of the rollout's first ``samples_per_step`` samples
        (their ``index`` in the batch; the driver adds each one's advantage)."""
        records: list[dict[str, Any]] = []
        for g in groups:
            for k, gen in enumerate(g.generations):
                if len(records) >= self.samples_per_step:
                    return records
                i = len(records)
                records.append({
                    "step": step, "index": i, "group": group_index[i],
                    "prompt": self.tokenizer.decode(g.prompt_ids[k],
                                                    skip_special_tokens=False),
                    "record_prompt": g.record_prompt, "response": g.texts[k],
                    "label": g.label, "reward": float(g.rewards[k]),
                    "rewards": {name: values[k] for name, values in g.parts.items()},
                    "response_tokens": len(gen.token_ids)})
        return records

    def _with_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        """The estimator's advantages (none yet when it needs the critic's values: the
        driver's), and a rollout.teacher's reverse-KL term on top of them."""
        if self.teacher is None:
            return batch if self.estimator.needs_critic else self.estimator.apply(batch)
        teacher, metadata = self._teacher_log_probs(batch)
        batch = dataclasses.replace(batch, metadata={**batch.metadata, **metadata})
        if self.estimator.needs_teacher:  # the teacher's term is the estimator's own
            return self.estimator.apply(batch, teacher_log_probs=teacher)
        if not self.estimator.needs_critic:
            batch = self.estimator.apply(batch)
        return Distill(self.teacher.coef).apply(batch, teacher_log_probs=teacher)

    def _teacher_log_probs(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The teachers' log-probs [N, S] of the sampled tokens (they score their shares
        at once), with ``distill/reverse_kl`` and ``perf/teacher_s``."""
        assert self.teacher is not None
        started = time.perf_counter()
        if not self.teachers:
            from rollout.tiny import resolve_model_path

            self.teachers = start_teachers(self.teacher, resolve_model_path(self.teacher.model))
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
        """Greedy and sampled responses to held-out prompts on the engines, scored by the
        job's reward function, with the weight version they came from. Seeds derive from
        (seed, "eval", step) and nothing of the training state changes, so training's
        stream and a resume stay exact."""
        key = dataset.model_dump_json()
        if key not in self._eval_records:
            self._eval_records[key] = load_prompt_dataset(dataset)
        greedy = self.config.sampling.model_copy(update={"temperature": 0.0})
        sampled = self.config.sampling.model_copy(update={"temperature": temperature})
        if self.turns is not None:
            return self._evaluate_episodes(self._eval_records[key][:num_prompts], num_samples,
                                           greedy, sampled, step)
        fitted = [(r, self._encode(r, f"held-out record {i}"))
                  for i, r in enumerate(self._eval_records[key][:num_prompts])]
        records = [r for r, ids in fitted if ids is not None]
        prompts = [ids for _, ids in fitted if ids is not None]
        greedy_out = self._generate(prompts, greedy, f"eval:{step}:greedy")
        sample_out = self._generate([p for p in prompts for _ in range(num_samples)], sampled,
                                    f"eval:{step}:sampled") if num_samples else []
        texts = decode_responses(self.tokenizer,
                                 [g.token_ids for g in greedy_out + sample_out])
        # greedy responses first, then each prompt's sampled ones
        each = list(range(len(records))) + [j for j in range(len(records))
                                             for _ in range(num_samples)]
        policy_prompts = [self.tokenizer.decode(ids, skip_special_tokens=False)
                          for ids in prompts]
        scores = self.rewarder.score([policy_prompts[j] for j in each],
                                     [records[j].prompt for j in each], texts,
                                     [records[j].label for j in each],
                                     [records[j].metadata for j in each], update_stats=False)
        rewards, outputs = scores.total, greedy_out + sample_out
        samples = [{"step": step, "eval": True, "greedy": i < len(records), "group": j,
                    "prompt": policy_prompts[j], "record_prompt": records[j].prompt,
                    "response": texts[i], "label": records[j].label, "reward": rewards[i],
                    "rewards": {k: v[i] for k, v in scores.parts.items()},
                    "response_tokens": len(outputs[i].token_ids)}
                   for i, j in enumerate(each)]
        sample_rewards = rewards[len(records):]
        return EvalRun(self.weight_version, [
            EvalOutcome(r.metadata, rewards[j], len(greedy_out[j].token_ids),
                        sample_rewards[j * num_samples:(j + 1) * num_samples],
                        [samples[j], *samples[len(records) + j * num_samples:
                                              len(records) + (j + 1) * num_samples]])
            for j, r in enumerate(records)])

    def _evaluate_episodes(self, records: list[PromptRecord], num_samples: int,
                           greedy: SamplingConfig, sampled: SamplingConfig, step: int
                           ) -> EvalRun:
        """:meth:`evaluate` with an environment: each outcome is an episode's reward (the
        greedy one's length is its response's, observations included)."""
        indices = list(range(len(records)))
        greedy_out, _ = self._play(records, indices, greedy, f"eval:{step}:greedy")
        sample_out, _ = self._play([r for r in records for _ in range(num_samples)],
                                   [i for i in indices for _ in range(num_samples)], sampled,
                                   f"eval:{step}:sampled") if num_samples else ([], 0.0)
        return EvalRun(self.weight_version, [
            EvalOutcome(r.metadata, greedy_out[j].reward, len(greedy_out[j].response_ids),
                        [e.reward for e in sample_out[j * num_samples:(j + 1) * num_samples]])
            for j, r in enumerate(records)])

    def _generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                  step: int | str, draw: int = 0, turn: EpisodeTurn | None = None
                  ) -> list[Generation]:
        """Responses to ``prompts`` sharded over the engines, in prompt order (``turn``:
        they are episodes' contexts, see rollout/engines/base.EpisodeTurn)."""
        refs = self._generate_refs(prompts, sampling, step, draw, turn)
        return [g for shard in ray.get(list(refs)) for g in shard]

    def _generate_refs(self, prompts: list[list[int]], sampling: SamplingConfig,
                       step: int | str, draw: int = 0, turn: EpisodeTurn | None = None
                       ) -> dict[Any, tuple[int, int]]:
        """Each engine's generate call on its shard of ``prompts``: ref -> (start, end)."""
        extra = {} if turn is None else {"turn": turn}
        return {engine.generate.remote(prompts[start:end], sampling,
                                       self._seed(step, draw, rank), **extra): (start, end)
                for rank, (engine, (start, end)) in enumerate(zip(
                    self.engines, shard_bounds(len(prompts), len(self.engines)), strict=True))
                if end > start}

    def _shards_as_done(self, prompts: list[list[int]], sampling: SamplingConfig,
                        step: int, draw: int
                        ) -> Iterator[tuple[tuple[int, int], list[Generation]]]:
        """:meth:`_generate`'s shards, each as its engine finishes it, with its bounds
        (a generator: the caller scores one while the other engines still generate)."""
        remaining = self._generate_refs(prompts, sampling, step, draw)
        while remaining:
            (ref,), _ = ray.wait(list(remaining), num_returns=1)
            yield remaining.pop(ref), ray.get(ref)

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

    def _reward_actor_list(self) -> list[Any]:
        return [actor for actors in self.reward_actors.values() for actor in actors]

    def engine_nodes(self) -> list[str]:
        """The Ray node id of each engine actor, in engine order."""
        return ray.get([engine.node_id.remote() for engine in self.engines])

    def shutdown(self) -> None:
        """Stop the teachers, and the engines (and any servers they launched) if they
        are ours."""
        for actor in [*self.teachers, *self._reward_actor_list()]:
            ray.kill(actor)
        self.teachers, self.reward_actors = [], {}
        if not self.owns_engines:
            self.engines = []
            return
        ray.get([engine.shutdown.remote() for engine in self.engines])
        for engine in self.engines:
            ray.kill(engine)
        self.engines = []


def _mean(values: list[float] | list[int] | list[bool]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def _part_metrics(groups: list[_Group]) -> dict[str, float]:
    """``reward/<name>/mean`` and ``/std`` of each reward part over the batch's samples."""
    names = list(groups[0].parts) if groups else []
    out: dict[str, float] = {}
    for name in names:
        values = torch.tensor([v for g in groups for v in g.parts[name]], dtype=torch.float64)
        out[f"reward/{name}/mean"] = float(values.mean())
        out[f"reward/{name}/std"] = float(values.std()) if len(values) > 1 else 0.0
    return out


RolloutManagerActor = ray.remote(num_cpus=0)(RolloutManager)
"""RolloutManager as a Ray actor class: ``RolloutManagerActor.remote(config, path)``."""
