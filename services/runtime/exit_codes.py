"""The one mapping from what went wrong to an exit code and the line a user reads, for
every program: each ``tally`` command (services/cli/) and ``python -m services.train``:

    0  done
    1  ran, and failed: a job that failed for good, a comparison out of tolerance, a job
       the controller reports failed
    2  refused before anything started: a config (each problem on its line), a flag, a
       file, model or checkpoint named
"""

from __future__ import annotations

import sys

FAILED = 1
REFUSED = 2


class Refused(Exception):
    """An input refused before anything started: exit 2; the message is the line."""


class Failed(Exception):
    """A run that failed: exit 1; the message is the line."""


REFUSED_ERRORS = {
    ("services.config.errors", "ConfigError"): "",  # its own lines, each naming a field
    ("trainer.export_base", "ExportError"): "error: ",
    ("rollout.pretrained", "ModelImportError"): "error: ",
}
"""(the module defining it, class) -> the prefix of its line: errors that mean a refused
input."""
FAILED_ERRORS = {("services.driver.loop", "JobFailed"): "error: "}
"""(module, class) -> the prefix of its line: errors that mean a failed run."""


def _is_instance(err: BaseException, module: str, name: str) -> bool:
    """``isinstance(err, module.name)`` without importing ``module``: an error of a class
    from a module never imported cannot be one, and importing it (torch behind
    trainer.export) would make every answer slow."""
    cls = getattr(sys.modules.get(module), name, None)
    return isinstance(cls, type) and isinstance(err, cls)


def exit_for(err: BaseException) -> tuple[int, str] | None:
    """(exit code, the line for stderr) of an error the mapping knows; None for any other
    (a bug: let it show its traceback)."""
    if isinstance(err, Refused):
        return REFUSED, str(err)
    if isinstance(err, Failed):
        return FAILED, str(err)
    for code, known in ((REFUSED, REFUSED_ERRORS), (FAILED, FAILED_ERRORS)):
        for (module, name), prefix in known.items():
            if _is_instance(err, module, name):
                return code, f"{prefix}{err}"
    return None
