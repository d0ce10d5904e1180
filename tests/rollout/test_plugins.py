"""rollout/plugins.py: a ``module:attr`` located and parsed without running any of its
code (the controller's check) says what the import would say; an environment's
class_path names a subclass of rollout.environments.Environment, never another callable."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rollout.environments import (
    Environment,
    load_environment_class,
    locate_environment_class,
)
from rollout.plugins import PluginError, check_object, locate_object
from tests.rollout.toy_envs import Countdown

FIELD = "rollout.reward.custom_function"
ENV_FIELD = "rollout.environment.class_path"


@pytest.fixture
def code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on the path whose every module and package writes ``imported.txt`` when
    its code runs."""
    folder = tmp_path / "code"
    (folder / "loud_pkg" / "inner").mkdir(parents=True)
    mark = f"open({str(tmp_path / 'imported.txt')!r}, 'a').write(__name__ + ' ')\n"
    (folder / "loud_pkg" / "__init__.py").write_text(mark)
    (folder / "loud_pkg" / "inner" / "__init__.py").write_text(mark)
    (folder / "loud_pkg" / "inner" / "rules.py").write_text(
        mark + "import json\nfrom . import x\n\ndef score(p, r, l):\n    return 0.0\n\n"
        "class Env:\n    pass\n\nif True:\n    alias = score\n")
    (folder / "loud_pkg" / "inner" / "x.py").write_text(mark)
    (folder / "syntax_rules.py").write_text("def score(:\n")
    (folder / "other_rules.py").write_text(mark + "def other():\n    local = 1\n")
    (folder / "needs_dep.py").write_text(mark + "import not_installed_dep\n")
    (folder / "lazy_rules.py").write_text(mark + "def __getattr__(name):\n    return None\n")
    monkeypatch.syspath_prepend(str(folder))
    return tmp_path


def test_a_located_module_runs_none_of_its_code_nor_its_packages(code: Path) -> None:
    for path in ("loud_pkg.inner.rules:score", "loud_pkg.inner.rules:Env",
                 "loud_pkg.inner.rules:alias", "loud_pkg.inner.rules:json",
                 "loud_pkg.inner.rules:x", "lazy_rules:anything"):
        locate_object(path, FIELD)
    assert not (code / "imported.txt").exists()
    assert not any(name.startswith(("loud_pkg", "lazy_rules")) for name in sys.modules)


@pytest.mark.parametrize(("path", "said"), [
    ("missing_rules:score", "cannot import module 'missing_rules': no module of that name"),
    ("loud_pkg.missing:score", "cannot import module 'loud_pkg.missing': no module"),
    ("syntax_rules:score", "cannot import module 'syntax_rules': SyntaxError: invalid "
                           "syntax (syntax_rules.py, line 1)"),
    ("other_rules:score", "module 'other_rules' has no callable 'score' (it defines: other)"),
    ("other_rules:local", "module 'other_rules' has no callable 'local'"),
    ("needs_dep:score", "cannot import module 'needs_dep': it needs 'not_installed_dep', "
                        "which is not installed here"),
    ("subprocess:Popen", "'subprocess' is a standard-library module, not user code"),
    ("os.path:join", "'os.path' is a standard-library module"),
    ("loud_pkg:score;rm", "expected 'module:function'"),
])
def test_what_cannot_be_imported_is_refused_without_importing(
        code: Path, path: str, said: str) -> None:
    with pytest.raises(PluginError) as err:
        locate_object(path, FIELD)
    assert str(err.value).startswith(f"{FIELD}: ") and said in str(err.value)
    assert not (code / "imported.txt").exists()


def test_the_import_says_the_same_in_the_job(code: Path) -> None:
    """The job's check (it imports) agrees with the located one where both can tell."""
    for path in ("other_rules:score", "needs_dep:score", "subprocess:Popen"):
        with pytest.raises(PluginError) as located:
            locate_object(path, FIELD)
        with pytest.raises(PluginError) as imported:
            check_object(path, FIELD)
        assert str(located.value) == str(imported.value)


@pytest.mark.parametrize("path", ["subprocess:Popen", "builtins:eval",
                                  "tests.rollout.reward_fns:length_reward"])
def test_a_class_path_names_an_environment_never_another_callable(path: str) -> None:
    with pytest.raises(PluginError, match=f"^{ENV_FIELD}: "):
        locate_environment_class(path)
    with pytest.raises(PluginError, match=f"^{ENV_FIELD}: "):
        load_environment_class(path)


def test_a_class_that_is_no_environment_subclass_is_refused_in_the_job(code: Path) -> None:
    """Located, a class is all the controller can tell; the job's import checks the base."""
    locate_environment_class("loud_pkg.inner.rules:Env")
    with pytest.raises(PluginError, match=r"does not subclass rollout\.environments\.Environment"):
        load_environment_class("loud_pkg.inner.rules:Env")
    cls = load_environment_class("tests.rollout.toy_envs:Countdown")
    assert cls is Countdown and issubclass(cls, Environment)
    locate_environment_class("rollout.environments.guess_number:GuessNumber")
