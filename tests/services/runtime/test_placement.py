"""What a job asks Ray for: its bundles (trainer ranks and engines), what it needs in all and
how a shortfall reads, and the threads of each phase. Gang placement on a real two-CPU Ray
(a job that does not fit waits holding nothing and says what it is missing) runs in
test_multinode.py, on the head of its cluster before the second node joins."""

from __future__ import annotations

import json

from services.config.job import load_job_config, parse_job_config
from services.runtime.placement import describe_shortfall, job_bundles, job_needs
from tests.services.controller.fakes import DEMO_OVERRIDES
from tests.services.test_train import ROOT


def demo(*overrides: str):
    return load_job_config(ROOT / "configs" / "demo.yaml", [*DEMO_OVERRIDES, *overrides])


def test_bundles_cover_ranks_and_engines() -> None:
    assert job_bundles(demo()) == [{"CPU": 0.75}, {"CPU": 0.5}]
    assert job_needs(demo("trainer.dp_size=2")) == {"CPU": 2.0}
    assert job_bundles(demo("trainer.dp_size=2", "colocate=true")) == [{"CPU": 0.75}] * 2
    assert describe_shortfall({"CPU": 2.5}, {"CPU": 2.0, "memory": 1e9}) == \
        "waiting for resources: needs 2.5 CPU, cluster has 2 free"


def test_distillation_teachers_have_bundles_of_their_own_after_the_engines() -> None:
    teachers = demo("rollout.teacher={model: tiny, num_actors: 2, num_cpus: 0.5}")
    assert job_bundles(teachers) == [{"CPU": 0.75}, {"CPU": 0.5}, {"CPU": 0.5}, {"CPU": 0.5}]
    assert job_needs(demo("rollout.advantage={type: distill, teacher: tiny}")) == {"CPU": 2.25}
    free = demo("rollout.teacher={model: tiny, num_cpus: 0}")  # needs nothing: no bundle
    assert job_bundles(free) == [{"CPU": 0.75}, {"CPU": 0.5}]


def test_reward_actors_have_bundles_after_the_teachers_and_before_the_critic() -> None:
    from services.runtime.placement import JobPlacement

    config = demo("rollout.teacher={model: tiny, num_cpus: 0.25}", "rollout.reward=["
                  "{type: exact_match}, {type: model, path: /rm, num_actors: 2, num_cpus: 0.5},"
                  " {type: judge, name: free, num_cpus: 0},"
                  " {type: judge, name: served, url: 'http://127.0.0.1:30000'},"
                  " {type: judge, name: j, num_cpus: 2, num_gpus: 1}]")
    assert job_bundles(config) == [{"CPU": 0.75}, {"CPU": 0.5}, {"CPU": 0.25}, {"CPU": 0.5},
                                   {"CPU": 0.5}, {"CPU": 2.0, "GPU": 1.0}]
    from services.runtime.placement import fields_asking

    # named by the part that asks (its index in rollout.reward), not by its actor's
    assert fields_asking(config, "CPU")[-2:] == ["rollout.reward[1].num_cpus",
                                                  "rollout.reward[4].num_cpus"]
    assert fields_asking(config, "GPU") == ["rollout.reward[4].num_gpus"]
    assert "rollout.teacher.num_cpus" in fields_asking(config, "CPU")
    gang = JobPlacement(object(), 1, 1, False, True, 1, [True, True, False, True])
    assert [o["scheduling_strategy"].placement_group_bundle_index if o else None
            for o in gang.reward_options] == [3, 4, None, 5]
    assert gang.critic_first_bundle == 6


def test_the_demo_fits_a_default_two_cpu_head_and_a_job_too_big_is_named_at_once() -> None:
    """``ray start --head`` on 2 cores offers 2 CPUs: the shipped demo fits it; a job
    larger than the whole cluster is refused with what it needs, what the cluster has and
    the fields to lower; ranks that fit the total but no one node are refused too."""
    from services.runtime.placement import never_fits

    two_cpus = [{"CPU": 2.0, "memory": 8e9}]
    assert never_fits(load_job_config(ROOT / "configs" / "demo.yaml"), two_cpus) is None
    why = never_fits(demo("trainer.dp_size=3"), two_cpus)
    assert why is not None and why.startswith(
        "the job can never fit this Ray cluster: it needs 2.75 CPU, the cluster has 2 CPU "
        "in all; lower trainer.num_cpus_per_rank / trainer.dp_size, rollout.engine.num_cpus")
    gpu = never_fits(demo("trainer.num_gpus_per_rank=1"), two_cpus)
    assert gpu is not None and "needs 1 GPU, the cluster has 0 GPU" in gpu
    assert "trainer.num_gpus_per_rank" in gpu
    split = never_fits(demo("trainer.dp_size=2"), [{"CPU": 1.0}, {"CPU": 1.0}])
    assert split is not None and "2 trainer ranks need 1.5 CPU on one node" in split
    assert never_fits(demo("trainer.dp_size=2", "trainer.allow_cross_node=true"),
                      [{"CPU": 1.0}, {"CPU": 1.0}]) is None


def test_threads_follow_the_phase_cores_and_set_values_win(tmp_path) -> None:
    from services.runtime.placement import phase_threads

    wide, narrow = tmp_path / "wide", tmp_path / "narrow"
    for folder, hidden in ((wide, 576), (narrow, 64)):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"hidden_size": hidden}))

    def threads(model, *overrides: str) -> tuple[int, int]:
        config = parse_job_config("", ["rollout.engine.type=torch", *overrides])
        return phase_threads(config, str(model), cores=8)

    # Synchronous: each phase has all 8 cores, split among its engines / ranks.
    assert threads(wide, "trainer.dp_size=2", "rollout.engine.num_engines=1") == (8, 4)
    assert threads(wide, "trainer.dp_size=4", "rollout.engine.num_engines=2") == (4, 2)
    # Async: generation and training run at once, each on its Ray CPU share.
    assert threads(wide, "rollout.async_steps=1", "rollout.engine.num_cpus=3",
                   "trainer.num_cpus_per_rank=2") == (3, 2)
    assert threads(wide, "rollout.async_steps=1") == (1, 1)  # 0.5 CPU: still one thread
    # The colocated fast path: a rank generates and trains in turn, on its share of all.
    assert threads(wide, "rollout.async_steps=1", "colocate=true", "trainer.dp_size=2",
                   "rollout.engine.num_engines=2")[1] == 4
    assert threads(narrow, "trainer.dp_size=1") == (1, 1)  # the tiny model: one thread
    assert threads(narrow, "rollout.engine.num_threads=3", "trainer.num_threads=5") == (3, 5)
