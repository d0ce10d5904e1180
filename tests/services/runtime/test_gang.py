"""The gang (services/runtime/gang.py) on a real local Ray cluster: it starts what its
roles ask for, once each, hands the manager exactly its actors, and ``close`` stops all
of them and frees the bundles even when one already died; a start that fails halfway
stops what it started. And it is the one module of services/, rollout/ and trainer/ that
starts Ray (read from the source with ``ast``)."""

from __future__ import annotations

import ast
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import ray

from rollout.tiny import create_tiny_checkpoint
from services.config.job import JobConfig, load_job_config
from services.driver.job import job_roles
from services.runtime.gang import ACTOR_STARTS_ENV, Gang, Roles, count_starts, warm_gangs
from services.runtime.placement import JobPlacement

ROOT = Path(__file__).resolve().parents[3]
SOURCES = ("services", "rollout", "trainer")
GANG = Path("services/runtime/gang.py")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "seed0", seed=0)


@pytest.fixture
def starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Counter[str]]:
    """Counts the actor starts of the test by role (TALLY_COUNT_ACTOR_STARTS)."""
    path = tmp_path / "actor_starts"
    monkeypatch.setenv(ACTOR_STARTS_ENV, str(path))
    return lambda: Counter(path.read_text().split()) if path.exists() else Counter()


def _config(*overrides: str) -> JobConfig:
    return load_job_config(ROOT / "configs" / "demo.yaml", [
        "warmup.enabled=false", "num_steps=1", "trainer.dp_size=1",
        "rollout.global_batch_size=16", "rollout.engine.num_engines=2", *overrides])


def _dead(actor: ray.actor.ActorHandle) -> bool:
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=60)
    except ray.exceptions.RayActorError:
        return True
    return False


def _dies(actor: ray.actor.ActorHandle, timeout_s: float = 60.0) -> bool:
    """Whether the GCS marks ``actor`` DEAD within ``timeout_s`` (ray.kill and a close
    return before the actor is gone; a call made in between may still be answered)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray._private.state.actors(actor._actor_id.hex())["State"] == "DEAD":
            return True
        time.sleep(0.2)
    return False


def _removed(group: object) -> bool:
    from ray.util.placement_group import placement_group_table

    return placement_group_table(group)["state"] == "REMOVED"


def _alive_actors() -> set[str]:
    return {actor_id for actor_id, actor in ray._private.state.actors().items()
            if actor["State"] != "DEAD"}


def test_count_starts_appends_one_line_per_actor(starts: Callable[[], Counter[str]]) -> None:
    count_starts("engine", 2)
    count_starts("manager")
    count_starts("teacher", 0)
    assert starts() == Counter({"engine": 2, "manager": 1})


@pytest.mark.slow  # a trainer rank, two engines and a manager on Ray
def test_a_job_gang_starts_each_role_once_and_close_stops_all_even_a_dead_one(
        ray_cluster: None, model_path: str, starts: Callable[[], Counter[str]]) -> None:
    config = _config()
    gang = Gang(config, model_path, job_roles(config, model_path), on_wait=print)
    try:
        assert starts() == Counter({"engine": 2, "manager": 1, "policy": 1})
        assert gang.critic is None and gang.teachers == [] and gang.reward_actors == {}
        handed = ray.get(gang.manager.__ray_call__.remote(
            lambda manager: [engine._actor_id.hex() for engine in manager.engines]))
        assert handed == [engine._actor_id.hex() for engine in gang.engines]
        assert len(gang.trainer.workers) == 1
        actors = [gang.manager, *gang.engines, *gang.trainer.workers]
        assert not any(_dead(actor) for actor in actors)  # all up before one dies
        ray.kill(gang.engines[0])
        assert _dies(gang.engines[0])
    finally:
        gang.close()
    assert all(_dies(actor) for actor in actors)
    assert gang.placement is not None and _removed(gang.placement.group)
    gang.close()  # a second close does nothing


@pytest.mark.slow  # an engine and a manager on Ray, then a failing rank group
def test_a_start_that_fails_halfway_stops_what_it_started(
        ray_cluster: None, model_path: str, starts: Callable[[], Counter[str]]) -> None:
    # One engine: what is stopped is every actor started before the failure, two of them
    # (engine, manager) and the placement group; a second engine adds only a start.
    config, placed = _config("rollout.engine.num_engines=1"), []
    before = _alive_actors()

    def failing_policy(placement: JobPlacement | None) -> None:
        placed.append(placement)
        raise RuntimeError("the ranks cannot start")

    roles = Roles(policy=failing_policy, engines=True, manager=True)
    with pytest.raises(RuntimeError, match="the ranks cannot start"):
        Gang(config, model_path, roles)
    assert starts() == Counter({"engine": 1, "manager": 1})  # started, then stopped
    assert placed[0] is not None and _removed(placed[0].group)
    deadline = time.monotonic() + 60
    while (left := _alive_actors() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left


# ---- a warm gang: parked, then reused ----------------------------------------------------


def _renewed_state(gang: Gang) -> dict[str, object]:
    """What a job's actors hold that a new actor of each would not: an engine's weight
    version, the manager's next group and its engines, a rank's planted attribute."""
    return {
        "engine": ray.get(gang.engines[0].__ray_call__.remote(
            lambda engine: engine.weight_version), timeout=60),
        "manager": ray.get(gang.manager.__ray_call__.remote(lambda manager: (
            manager.next_group_index, [e._actor_id.hex() for e in manager.engines])),
            timeout=60),
        "rank": ray.get(gang.trainer.workers[0].__ray_call__.remote(
            lambda rank: getattr(rank, "left_by_a_job", None)), timeout=60),
    }


def _leave_state(gang: Gang) -> None:
    ray.get([gang.engines[0].__ray_call__.remote(
                 lambda engine: setattr(engine, "weight_version", 7)),
             gang.manager.__ray_call__.remote(
                 lambda manager: setattr(manager, "next_group_index", 96)),
             gang.trainer.workers[0].__ray_call__.remote(
                 lambda rank: setattr(rank, "left_by_a_job", True))], timeout=60)


@pytest.mark.slow  # a rank, an engine and a manager on Ray, twice
def test_a_parked_gang_is_reused_renewed_and_one_with_a_dead_actor_is_replaced(
        ray_cluster: None, model_path: str, starts: Callable[[], Counter[str]]) -> None:
    """Inside warm_gangs a gang closed healthy is parked (its actors and bundles kept);
    the next gang of its key takes the same processes, each a new actor of the new config
    (nothing a job left in them survives), starting none; a gang closed after a failure
    stops; and a parked gang with a dead actor is stopped and a fresh one started."""
    config = _config("rollout.engine.num_engines=1")
    one_of_each = Counter({"engine": 1, "manager": 1, "policy": 1})
    with warm_gangs():
        first = Gang(config, model_path, job_roles(config, model_path))
        assert not first.reused and starts() == one_of_each
        actors = [first.manager, *first.engines, *first.trainer.workers]
        fresh = _renewed_state(first)
        _leave_state(first)
        assert _renewed_state(first) != fresh
        first.close(healthy=True)
        assert not any(_dead(actor) for actor in actors)  # parked, not stopped
        assert first.placement is not None and not _removed(first.placement.group)

        again = Gang(config, model_path, job_roles(config, model_path))
        assert again.reused and starts() == one_of_each  # nothing started
        assert [again.manager, *again.engines, *again.trainer.workers] == actors
        assert again.placement is first.placement
        assert _renewed_state(again) == fresh  # every actor as a new one
        again.close(healthy=True)  # parked again
        ray.kill(again.engines[0])
        assert _dies(again.engines[0])

        replaced = Gang(config, model_path, job_roles(config, model_path))
        assert not replaced.reused and starts() == one_of_each + one_of_each
        assert all(_dies(actor) for actor in actors)  # the parked gang, stopped
        assert _removed(first.placement.group)
        replaced.close(healthy=False)  # as after an actor failure: stopped, not parked
        assert all(_dies(actor) for actor in
                   [replaced.manager, *replaced.engines, *replaced.trainer.workers])


def test_a_gang_of_another_key_stops_the_parked_one_and_the_block_stops_the_last(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At most one gang is parked, and only inside warm_gangs: a gang of another key (or
    none) stops it before it starts, and the end of the block stops what is parked."""
    from services.runtime import gang as gang_module

    monkeypatch.setattr(gang_module, "_parked", None)  # outside the session's pool

    def actorless(key: str | None) -> Gang:
        return Gang(None, "", Roles(place=False, reuse_key=key))

    outside = actorless("a")
    outside.close(healthy=True)
    assert gang_module._parked is None  # no pool: stopped
    with warm_gangs():
        parked = actorless("a")
        parked.close(healthy=True)
        assert gang_module._parked == [parked]
        other = actorless("b")
        assert not other.reused and gang_module._parked == []
        other.close(healthy=True)
        assert actorless("b").reused and gang_module._parked == []
        keyless = actorless(None)
        keyless.close(healthy=True)
        assert gang_module._parked == []  # no key: never parked
        last = actorless("b")
        last.close(healthy=True)
        assert gang_module._parked == [last]
    assert gang_module._parked is None


# ---- one module starts Ray --------------------------------------------------------------


def ray_init_calls(root: Path, files: Iterator[Path] | None = None) -> list[str]:
    """``path:line`` of each ``ray.init(...)`` call (or ``from ray import init``) under
    ``root`` outside services/runtime/gang.py."""
    found = []
    for path in files if files is not None else (
            p for source in SOURCES for p in sorted((root / source).rglob("*.py"))):
        where = path.relative_to(root)
        if where == GANG:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            calls_init = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                          and node.func.attr == "init" and isinstance(node.func.value, ast.Name)
                          and node.func.value.id == "ray")
            imports_init = (isinstance(node, ast.ImportFrom) and node.module == "ray"
                            and any(alias.name == "init" for alias in node.names))
            if calls_init or imports_init:
                found.append(f"{where}:{node.lineno}")
    return found


def test_only_the_gang_starts_ray() -> None:
    assert ray_init_calls(ROOT) == []
    gang_source = (ROOT / GANG).read_text()
    assert "ray.init(" in gang_source  # the one place, still there


def test_the_ray_init_checker_finds_a_planted_call(tmp_path: Path) -> None:
    planted = tmp_path / "services" / "elsewhere.py"
    planted.parent.mkdir()
    planted.write_text("import ray\n\n\ndef start():\n    ray.init(num_cpus=1)\n")
    imported = tmp_path / "rollout.py"
    imported.write_text("from ray import init\n")
    assert ray_init_calls(tmp_path, iter([planted, imported])) == [
        "services/elsewhere.py:5", "rollout.py:1"]


HEAD_ENV_SCRIPT = """
import json, os, ray
from services.runtime.gang import actor_env, actor_options, start_local_head
from services.runtime.quiet import HEAD_ENV, QUIET_ENV

os.environ["OMP_NUM_THREADS"] = "3"  # the user's own, kept in this process
start_local_head(1, log_to_driver=True)  # as a job's own head (ensure_ray)


@ray.remote(num_cpus=0)
def seen() -> dict:
    return {"env": {k: os.environ.get(k) for k in QUIET_ENV},
            "runtime_env": ray.get_runtime_context().runtime_env}


def log_monitor_env() -> dict | None:  # of this head's log monitor (one of its processes)
    flag = f"--gcs-address={ray.get_runtime_context().gcs_address}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmd:
                words = cmd.read().split(b"\\0")
            with open(f"/proc/{pid}/environ", "rb") as env:
                pairs = [item.split(b"=", 1) for item in env.read().split(b"\\0") if item]
        except OSError:
            continue
        if any(w.endswith(b"log_monitor.py") for w in words) and flag in words:
            return {k.decode(): v.decode() for k, v in pairs}
    return None


try:
    said = {"driver": os.environ["OMP_NUM_THREADS"], "actor_env": actor_env(),
            "driver_head_env": {k: os.environ.get(k) for k in HEAD_ENV},
            "log_monitor": {k: log_monitor_env().get(k) for k in HEAD_ENV},
            "options": actor_options(),
            "worker": ray.get(seen.options(**actor_options()).remote(), timeout=120)}
finally:
    ray.shutdown()
start_local_head(1, log_to_driver=False)  # as the suite's shared heads
try:
    said["quiet_head_log_monitor"] = log_monitor_env()
finally:
    ray.shutdown()
print(json.dumps(said))
"""


@pytest.mark.slow  # a Ray head of its own, in a subprocess
def test_a_head_we_start_gives_its_workers_the_quiet_env_without_a_runtime_env() -> None:
    """start_local_head: the head's workers have QUIET_ENV (OMP_NUM_THREADS=1 even where
    the user set another), so actors need no runtime_env (Ray's setup_worker, a second
    interpreter per actor); the driver keeps the user's value. The head's log monitor
    has HEAD_ENV; a head whose driver takes no worker logs (``log_to_driver=False``) has
    none."""
    import json
    import subprocess
    import sys

    from services.runtime.quiet import HEAD_ENV, QUIET_ENV

    done = subprocess.run([sys.executable, "-c", HEAD_ENV_SCRIPT], cwd=ROOT, timeout=240,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["driver"] == "3"
    assert said["actor_env"] == {} and said["options"] == {}
    assert said["worker"]["env"] == QUIET_ENV
    assert not said["worker"]["runtime_env"].get("env_vars")
    assert said["log_monitor"] == HEAD_ENV  # the head's own processes: HEAD_ENV too
    assert said["driver_head_env"] == {k: None for k in HEAD_ENV}  # put back after
    assert said["quiet_head_log_monitor"] is None


def test_a_joined_cluster_gets_the_quiet_env_by_runtime_env(ray_cluster: None) -> None:
    """On a head other than the one start_local_head last started (here: that one said
    to be another address), every actor carries QUIET_ENV in its runtime_env."""
    from services.runtime import gang
    from services.runtime.quiet import QUIET_ENV

    quiet, gang._quiet_head = gang._quiet_head, "127.0.0.1:1"
    try:
        assert gang.actor_env() == QUIET_ENV
        assert gang.actor_options() == {"runtime_env": {"env_vars": QUIET_ENV}}
    finally:
        gang._quiet_head = quiet
    assert gang.actor_env() == {}  # the session's shared head is started quiet
