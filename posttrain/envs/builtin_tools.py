"""Built-in tools: `calculator` (exact arithmetic over a parsed expression), `calculate` (the same, one operation
per call: chained problems need one call per step) and `python` (the reward sandbox).

Both answer with a string in every case, errors included ("Error: ..."), so the model reads what went wrong.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from decimal import Decimal, DivisionByZero, InvalidOperation, localcontext
from typing import Any

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100  # 10**100 is still exact; 2**10**10 would hang the process
MAX_RESULT_DIGITS = 100  # any intermediate value past this many digits ends the evaluation
DECIMAL_PRECISION = 28

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


class _CalculatorError(ValueError):
    pass


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Args:
        expression: An arithmetic expression with numbers, + - * / // % ** and parentheses, e.g. "347 * 29".
    """
    if not isinstance(expression, str):
        return f"Error: the expression must be a string, got {type(expression).__name__}"
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"Error: the expression is longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return f"Error: cannot parse {expression!r} as arithmetic"
    try:
        with localcontext() as context:
            context.prec = DECIMAL_PRECISION
            value = _evaluate(tree.body)
    except _CalculatorError as error:
        return f"Error: {error}"
    except (ZeroDivisionError, DivisionByZero):
        return "Error: division by zero"
    except InvalidOperation:
        return f"Error: {expression!r} has no defined value"
    return _format(value)


def _evaluate(node: ast.AST) -> int | Decimal:
    """Integers stay exact ints; a decimal literal or a true division makes the value a Decimal."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        # floats are read back from their source digits ("0.1" stays 0.1, not the binary float's expansion)
        return _bounded(node.value if isinstance(node.value, int) else Decimal(repr(node.value)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _evaluate(node.operand)
        return _bounded(-operand if isinstance(node.op, ast.USub) else operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_exponent(right)
        if isinstance(node.op, ast.Div) or (isinstance(node.op, ast.Pow) and right < 0):
            left = Decimal(left)  # exact decimal, never a binary float
        return _bounded(_BINARY[type(node.op)](left, right))
    raise _CalculatorError(f"unsupported element {ast.unparse(node)!r} (numbers, + - * / // % ** and parentheses only)")


def _check_exponent(exponent: int | Decimal) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise _CalculatorError(f"exponent {exponent} is beyond the limit of {MAX_EXPONENT}")


def _bounded(value: int | Decimal) -> int | Decimal:
    if isinstance(value, Decimal) and not value.is_finite():
        raise _CalculatorError("the value is not a finite number")
    digits = len(str(abs(value))) if isinstance(value, int) else value.adjusted() + 1
    if digits > MAX_RESULT_DIGITS:
        raise _CalculatorError(f"a value has more than {MAX_RESULT_DIGITS} digits")
    return value


def _format(value: int | Decimal) -> str:
    if isinstance(value, int):
        return str(value)
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def calculate(expression: str) -> str:
    """Compute one arithmetic operation on two numbers and return the result.

    Args:
        expression: Two numbers and one operator (+ - * / // %), e.g. "347 * 29". One operation per call.
    """
    if isinstance(expression, str) and len(expression) <= MAX_EXPRESSION_CHARS:
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError:
            tree = None  # the calculator words the error
        operations = 0 if tree is None else sum(isinstance(node, ast.BinOp) for node in ast.walk(tree))
        if operations > 1:
            return f"Error: one operation per call ({expression!r} has {operations}); call again for the next step"
    return calculator(expression)


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it printed (stdout, then stderr).

    Args:
        code: The Python source to run; use print() to show results. No network, no files outside a scratch dir.
    """
    from posttrain.rewards.sandbox import SandboxError, run_sandboxed

    if not isinstance(code, str):
        return f"Error: the code must be a string, got {type(code).__name__}"
    try:
        result = run_sandboxed(code, cpu_seconds=5, wall_seconds=10, max_output_bytes=16 * 2**10)
    except SandboxError as error:
        return f"Error: {error}"
    parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    if result.stderr.strip():
        parts.append("stderr:\n" + result.stderr.rstrip("\n"))
    if result.status != "ok":
        parts.append(f"(the program ended with status {result.status!r})")
    elif result.exit_code:
        parts.append(f"(exit code {result.exit_code})")
    return "\n".join(parts) if parts else "(no output)"


BUILTIN_TOOLS: dict[str, Callable[..., str]] = {"calculator": calculator, "calculate": calculate, "python": python}
