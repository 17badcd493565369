"""The built-in tools: the calculator's exact arithmetic and refusals, and python through the sandbox."""

from __future__ import annotations

import pytest

from posttrain.envs.builtin_tools import calculator, python
from posttrain.envs.tools import as_tool


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("347 * 29", "10063"),
        ("(1 + 2) * -3", "-9"),
        ("7 / 2", "3.5"),
        ("8 / 2", "4"),
        ("10 // 3", "3"),
        ("17 % 5", "2"),
        ("2 ** 10", "1024"),
        ("2 ** -3", "0.125"),
        ("0.1 + 0.2", "0.3"),
        ("1.5 * 4", "6"),
        ("123456789 * 987654321", "121932631112635269"),
    ],
)
def test_arithmetic_is_exact(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1 / 0", "Error: division by zero"),
        ("2 ** 1000", "Error: exponent 1000 is beyond the limit of 100"),
        ("2 ** 2 ** 2 ** 2 ** 2", "Error: exponent 65536 is beyond the limit"),
        ("9" * 60 + " * " + "9" * 60, "Error: a value has more than 100 digits"),
        ('__import__("os").system("true")', "Error: unsupported element"),
        ("x + 1", "Error: unsupported element 'x'"),
        ("[1, 2]", "Error: unsupported element"),
        ("True + 1", "Error: unsupported element 'True'"),
        ("1e999", "Error: the value is not a finite number"),
        ("3 +", "Error: cannot parse"),
        ("1" * 201, "Error: the expression is longer than 200 characters"),
    ],
)
def test_refusals_are_messages(expression, message):
    assert calculator(expression).startswith(message)


def test_builtins_have_schemas():
    assert as_tool(calculator).schema["function"]["parameters"]["required"] == ["expression"]
    assert as_tool(python).schema["function"]["parameters"]["properties"]["code"]["type"] == "string"


def test_python_runs_in_the_sandbox():
    assert python("print(6 * 7)") == "42"
    assert python("pass") == "(no output)"
    failed = python("raise ValueError('no')")
    assert "stderr:" in failed and "ValueError: no" in failed and "(exit code 1)" in failed
    assert "(the program ended with status 'violation')" in python(
        "import socket; socket.socket().connect(('1.1.1.1', 80))"
    )
