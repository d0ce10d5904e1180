"""The trainer's boundaries, read from its source with ``ast`` (nothing imported):

- nothing under ``trainer/`` imports ``rollout.engines`` or ``rollout.config`` (the
  trainer never hosts an inference engine; a colocated one is composed in services);
- no rank class under ``trainer/`` (``TrainerRank`` and whatever derives from it) raises
  ``NotImplementedError`` from a method: a rank has its role's verbs, never stubs for
  another role's (ARCHITECTURE.md, "Ranks are roles"). A rank that cannot map a model
  (Megatron's converter) raises from a helper it calls, which is not a verb.

Each checker is also run on a planted file, so a checker that finds nothing fails here.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

TRAINER = Path(__file__).resolve().parents[2] / "trainer"
FORBIDDEN = ("rollout.engines", "rollout.config")
RANK_BASE = "TrainerRank"
"""The base of every rank class (trainer/worker.py)."""


def _modules(root: Path) -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(root.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _imported(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, module) of every import, at any depth (a lazy import in a function too)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.lineno, node.module
            # ``from rollout import engines`` names the package in the alias
            yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)


def forbidden_imports(root: Path) -> list[str]:
    """``path:line module`` of each import statement of a forbidden module under
    ``root`` (one entry per statement)."""
    found = {}
    for path, tree in _modules(root):
        for line, module in _imported(tree):
            if any(module == f or module.startswith(f + ".") for f in FORBIDDEN):
                found.setdefault(f"{path.relative_to(root)}:{line}", module)
    return [f"{where} {module}" for where, module in found.items()]


def _raises_not_implemented(node: ast.AST) -> bool:
    if not isinstance(node, ast.Raise) or node.exc is None:
        return False
    exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else b.attr for b in cls.bases
            if isinstance(b, ast.Name | ast.Attribute)]


def rank_classes(root: Path, base: str = RANK_BASE) -> list[tuple[Path, ast.ClassDef]]:
    """``base`` and every class under ``root`` deriving from it, by name, through any
    chain of classes defined under ``root``."""
    classes = [(path, cls) for path, tree in _modules(root)
               for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)]
    bases = {cls.name: _base_names(cls) for _, cls in classes}
    ranks, grew = {base}, True
    while grew:  # the classes reaching ``base``, however many hops away
        grew = False
        for name, parents in bases.items():
            if name not in ranks and ranks.intersection(parents):
                ranks.add(name)
                grew = True
    return [(path, cls) for path, cls in classes if cls.name in ranks]


def stub_methods(root: Path) -> list[str]:
    """``path:Class.method`` of each method of a rank class under ``root`` that raises
    NotImplementedError (anywhere in its body)."""
    return [f"{path.relative_to(root)}:{cls.name}.{method.name}"
            for path, cls in rank_classes(root) for method in cls.body
            if isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef)
            and any(map(_raises_not_implemented, ast.walk(method)))]


def test_the_trainer_imports_no_engine_and_no_rollout_config() -> None:
    assert forbidden_imports(TRAINER) == []


def test_no_rank_class_raises_not_implemented() -> None:
    assert stub_methods(TRAINER) == []


def test_the_checker_walks_every_role_s_rank() -> None:
    """A renamed base would leave the checker checking nothing: every role's rank class
    and each backend's is among the classes it walks."""
    walked = {cls.name for _, cls in rank_classes(TRAINER)}
    assert {"TrainerRank", "BatchRank", "PolicyRank", "FSDPRank", "FSDPWorker",
            "FSDPCriticWorker", "FSDPRewardModelWorker", "MegatronWorker"} <= walked


@pytest.mark.parametrize("line", [
    "from rollout.engines.torch_engine import TorchEngine",
    "import rollout.config",
    "from rollout import engines",
    "def lazy():\n    from rollout.config import SamplingConfig",
])
def test_the_import_checker_finds_a_planted_import(tmp_path: Path, line: str) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "ok.py").write_text("from rollout.batch import RolloutBatch\n"
                                            "from rollout.weight_bucket import DTYPES\n")
    (tmp_path / "pkg" / "planted.py").write_text(line + "\n")
    found = forbidden_imports(tmp_path)
    assert len(found) == 1 and found[0].startswith("pkg/planted.py:"), found


def test_the_stub_checker_finds_a_planted_stub(tmp_path: Path) -> None:
    (tmp_path / "base.py").write_text("class TrainerRank:\n    def setup(self):\n"
                                      "        pass\n")
    (tmp_path / "ranks.py").write_text(
        "import base\n"
        "class Head(base.TrainerRank):\n    pass\n"
        "class Critic(Head):\n"
        "    def values(self):\n        return 1\n"
        "    def log_probs(self):\n"
        "        raise NotImplementedError('the critic has values')\n"
        "class Converter:  # not a rank: a model it cannot map is its error to raise\n"
        "    def __init__(self):\n        raise NotImplementedError('no mapping')\n")
    assert stub_methods(tmp_path) == ["ranks.py:Critic.log_probs"]
