"""Multi-turn environments: what the policy acts in when ``rollout.environment`` is set.

An environment is a subclass of :class:`Environment` with this interface
(``rollout.environment.class_path`` names it as ``module:Class``)::

    class MyEnv(Environment):
        def __init__(self, **kwargs): ...   # rollout.environment.kwargs
        def reset(self, record: dict) -> str: ...
            # record {"prompt", "label", "metadata"} -> the first observation
        def step(self, action: str) -> tuple[str | None, float, bool]: ...
            # the policy's turn -> (observation, reward, done)

One instance is made per episode, so an instance may keep the episode's state.
``reset`` gets the dataset record and returns the first observation, which becomes the
prompt. ``step`` gets the action: the decoded text of the policy's turn, special tokens
skipped. A turn ends at EOS, at a stop string (which stays in the action, e.g. a
trailing ``</calc>``) or at a token budget. ``step`` returns the next observation (None
when there is none), a reward and whether the episode is over. The episode's reward is
the sum of its step rewards. Chat models see each observation as a new user (or tool)
turn; plain models see it appended as text. The framework runs the loop and caps turns
and tokens (rollout/episodes.py); either method may also be ``async def``.

An environment must be deterministic given (kwargs, record): no unseeded randomness
(derive any randomness from the record, e.g. a hash of its prompt), so that a resumed
run replays exactly.

Built-ins:

    rollout.environments.calculator:Calculator      math word problems with a <calc> tool
    rollout.environments.guess_number:GuessNumber   guess a secret number, told higher/lower
"""

from __future__ import annotations

from typing import Any

from rollout.plugins import load_subclass, locate_object

CLASS_PATH_FIELD = "rollout.environment.class_path"


class Environment:
    """The base every environment subclasses (``class MyEnv(Environment)``): the interface
    above. ``class_path`` must name a subclass, so a config can never make the job call
    an arbitrary callable (``subprocess:Popen`` with ``kwargs``) in its place."""

    def reset(self, record: dict[str, Any]) -> str:
        raise NotImplementedError

    def step(self, action: str) -> tuple[str | None, float, bool]:
        raise NotImplementedError


def load_environment_class(path: str, field: str = CLASS_PATH_FIELD) -> type[Environment]:
    """The class ``path`` names, imported (in the job only), an Environment."""
    return load_subclass(path, field, Environment, "rollout.environments",
                         "an environment must (class MyEnv(Environment), "
                         "docs/environments.md)")


def locate_environment_class(path: str, field: str = CLASS_PATH_FIELD) -> None:
    """The controller's check of ``path``, importing nothing (rollout.plugins)."""
    locate_object(path, field, want_class=True)
