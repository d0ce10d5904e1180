r"""Calculator: math word problems solved with a ``<calc>`` tool, answered in ``\boxed{}``.

    reset(record)  the tool's instructions and a worked example, then the problem (the
                   record's prompt without the answer-format line math_words adds)
    step(action)   \boxed{x} in the action     -> done, answer_reward if x matches the label
                                                  (rewards.boxed_match: numerically when
                                                  both parse, |x − y| ≤ tol · max(1, |y|))
                   else <calc>e</calc> (last)  -> "<result>value</result>", tool_call_reward
                                                  (the first call that computes; every
                                                  call when negative)
                   else                        -> a hint, 0

Expressions are evaluated on their syntax tree, never by ``eval()``: numbers, + − * /
// % **, unary signs and parentheses, nothing else (no names, calls or attributes). An
expression has at most MAX_EXPRESSION_CHARS characters, an exponent at most MAX_EXPONENT
and every value stays within MAX_MAGNITUDE (a power is refused before it is computed),
so no expression can take long or exhaust memory. A refused or failing expression is
answered ``<result>error: …</result>``; integers are written without ".0", other values
with up to 10 significant digits.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable
from typing import Any

from rollout.environments import Environment
from rollout.math_words import ANSWER_INSTRUCTIONS
from rollout.rewards import boxed_match, extract_boxed

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 1000
MAX_DIGITS = 100
MAX_MAGNITUDE = 10**MAX_DIGITS

INSTRUCTIONS = (
    "Solve with a calculator: write <calc>expression</calc> to get <result>value</result>, "
    "then give the answer as \\boxed{number}.\n\n"
    "Q: Sam has 3 bags of 12 marbles and gives away 5. How many marbles does he have?\n"
    "A: <calc>3*12-5</calc>\n"
    "<result>31</result>\n"
    "The answer is \\boxed{31}."
)
"""The tool's instructions and one worked example, short and in question/answer form: a
135 M model given a longer preamble rarely calls the tool or boxes an answer, and the
first turn prefills it for every prompt (later turns reuse its KV:
rollout/engines/prefix_cache.py)."""
HINT = "Use <calc>expression</calc> to compute, or give the final answer as \\boxed{N}."

_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}
# The record's own answer line ("…put the final answer in \boxed{}", or "Reply with the
# answer only") would contradict or repeat the tool's instructions: math_words owns it.
_ANSWER_LINES = frozenset(ANSWER_INSTRUCTIONS.values())


class CalcError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is shown."""


class Calculator(Environment):
    """One episode of a math word problem with a calculator tool (see the module doc)."""

    def __init__(self, answer_reward: float = 1.0, tool_call_reward: float = 0.0,
                 tolerance: float = 1e-6) -> None:
        self.answer_reward = answer_reward
        self.tool_call_reward = tool_call_reward
        """Paid for the episode's first <calc> call that computes a value (a format reward
        that teaches a small model to use the tool; negative: a cost per call, every
        call)."""
        self.tolerance = tolerance
        """Relative tolerance of a numeric answer, as reward.numeric_tolerance."""
        self.tool_calls = 0
        """<calc> calls of this episode, refused ones included."""
        self._call_paid = False
        self._label: str | None = None
        self._metadata: dict[str, Any] = {}

    def reset(self, record: dict[str, Any]) -> str:
        label = record.get("label")
        if label is None:
            raise ValueError("Calculator needs records with a label (the numeric answer)")
        self._label, self._metadata = str(label), dict(record.get("metadata") or {})
        self.tool_calls, self._call_paid = 0, False
        return f"{INSTRUCTIONS}\n\nQ: {_problem_text(record['prompt'])}\nA:"

    def step(self, action: str) -> tuple[str | None, float, bool]:
        if self._label is None:
            raise RuntimeError("Calculator.step before reset")
        if extract_boxed(action) is not None:
            correct = boxed_match([action], [self._label], [self._metadata], self.tolerance)[0]
            return None, self.answer_reward * correct, True
        calls = _CALL.findall(action)
        if calls:
            self.tool_calls += 1
            result = calculate(calls[-1])
            computed = not result.startswith("error")
            paid = self.tool_call_reward < 0 or (computed and not self._call_paid)
            self._call_paid |= paid
            return f"<result>{result}</result>", self.tool_call_reward * paid, False
        return HINT, 0.0, False


def calculate(expression: str) -> str:
    """The expression's value as text, or ``error: why`` (never raises)."""
    try:
        return format_number(evaluate(expression))
    except CalcError as e:
        return f"error: {e}"


def format_number(value: int | float) -> str:
    """Integers (and integral floats below 1e15) without ".0"; others to 10 digits."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.10g}"


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalcError for anything else."""
    text = expression.strip()
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    text = text.replace("×", "*").replace("÷", "/")  # what models write for * and /
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalcError("not an arithmetic expression") from None
    return _value(tree.body)


def _value(node: ast.expr) -> int | float:
    # type() rather than isinstance(): bool is an int, and True is no number here
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except OverflowError:
            raise CalcError("number too large") from None
    raise CalcError("only numbers, + - * / // % ** and parentheses are allowed")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power before computing it: 9**9**9 would take minutes and gigabytes."""
    if abs(exponent) > MAX_EXPONENT:
        raise CalcError(f"exponent larger than {MAX_EXPONENT}")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > MAX_DIGITS:
        raise CalcError("number too large")


def _checked(value: Any) -> int | float:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise CalcError("not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("number too large")
    if abs(value) > MAX_MAGNITUDE:
        raise CalcError("number too large")
    return value


def _problem_text(prompt: str | list[dict[str, str]]) -> str:
    """The problem of a record's prompt: its text, or its user messages' text (chat)."""
    if isinstance(prompt, str):
        text = prompt
    else:
        user = [m["content"] for m in prompt if m.get("role") == "user"]
        text = "\n\n".join(user or [m["content"] for m in prompt])
    head, _, last = text.rstrip().rpartition("\n")
    return head.rstrip() if head and last.strip() in _ANSWER_LINES else text.strip()
