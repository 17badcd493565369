"""Code-execution reward: run the program in a completion against the row's tests, in the sandbox.

The `tests` column holds, per row, one of

- a list of stdin/stdout cases: `[{"input": "1 2\\n", "output": "3\\n"}, ...]`;
- the same as two lists (APPS style): `{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}`;
- a string of Python run after the program in its namespace: each top-level `assert` statement is one
  case, run after every non-assert statement above it (and without the other asserts); a string with no
  top-level assert is one case that passes when it runs to its end (e.g. HumanEval's `check(fn)`).

A stdin/stdout case passes when the program exits with status 0 and its stdout equals the expected
output after trailing whitespace is removed from each line and trailing empty lines are dropped —
nothing else is forgiven, so printing only the first lines of the answer fails. An assert case passes
when the check runs to its end. The reward is the fraction of cases passed.

A program that ends any case outside the sandbox's limits (timeout, memory, process or file-size limit,
too much output, a refused network/exec/ctypes call, a crash by a signal) makes the sample unscorable
(None): such an end may come from the machine (a loaded host times out good code) and says nothing
certain about the answer. A Python exception is the program's own answer: that case fails. A row with
no tests is unscorable too; a `tests` value of another type is an error.
"""

from __future__ import annotations

import ast
import re
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from posttrain.rewards.base import RewardError, RewardFn, completion_text
from posttrain.rewards.sandbox import SandboxResult, run_sandboxed

# ```python ... ``` (also py / python3, or no language); an unclosed last fence runs to the end
_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = ("python", "py", "python3")


@dataclass(frozen=True)
class CodeCase:
    """One case: `stdin` for the program and either its `expected` stdout or a `check` source to run."""

    stdin: str = ""
    expected: str | None = None
    check: str | None = None


def extract_code(text: str) -> str:
    """The program in a completion: its last ```python block, else its last unlabelled ``` block, else
    the whole text."""
    blocks = _FENCE_RE.findall(text)
    for wanted in (lambda tag: tag.lower() in _PYTHON_TAGS, lambda tag: tag == ""):
        chosen = [body for tag, body in blocks if wanted(tag)]
        if chosen:
            return chosen[-1]
    return text


def normalize_output(text: str) -> str:
    """Trailing whitespace off every line, trailing empty lines dropped; the rest must match exactly."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def parse_tests(value: Any, *, index: int = 0) -> list[CodeCase] | None:
    """A row's `tests` value as cases (format in the module docstring); None when it has none."""
    if value is None:
        return None
    if isinstance(value, str):
        return _assert_cases(value, index) if value.strip() else None
    if isinstance(value, Mapping) and "inputs" in value and "outputs" in value:
        inputs, outputs = value["inputs"], value["outputs"]
        if not isinstance(inputs, Sequence) or not isinstance(outputs, Sequence) or len(inputs) != len(outputs):
            raise TypeError(f"tests[{index}]: 'inputs' and 'outputs' must be lists of the same length")
        value = [{"input": i, "output": o} for i, o in zip(inputs, outputs)]
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        cases = []
        for case in value:
            if not (
                isinstance(case, Mapping)
                and isinstance(case.get("input", ""), str)
                and isinstance(case.get("output"), str)
            ):
                raise TypeError(f"tests[{index}]: each case must be {{'input': str, 'output': str}}, got {case!r:.80}")
            cases.append(CodeCase(stdin=case.get("input", ""), expected=case["output"]))
        return cases or None
    raise TypeError(
        f"tests[{index}] is a {type(value).__name__}; expected a list of {{'input', 'output'}} cases, "
        f"{{'inputs': [...], 'outputs': [...]}} or a string of assert statements"
    )


def _assert_cases(source: str, index: int) -> list[CodeCase]:
    try:
        statements = ast.parse(source).body
    except SyntaxError as error:
        raise ValueError(f"tests[{index}]: the assert source does not parse: {error}") from None
    segments = [ast.get_source_segment(source, node) or "" for node in statements]
    asserts = [k for k, node in enumerate(statements) if isinstance(node, ast.Assert)]
    if not asserts:
        return [CodeCase(check=source)]
    return [CodeCase(check="\n".join(segments[j] for j in range(k + 1) if j == k or j not in asserts)) for k in asserts]


def _passed(case: CodeCase, result: SandboxResult) -> bool:
    if case.check is not None:
        return bool(result.check_passed)
    return (
        result.exit_code == 0
        and not result.stdout_truncated
        and normalize_output(result.stdout) == normalize_output(case.expected or "")
    )


def code_reward(
    *,
    cpu_seconds: float = 5.0,
    wall_seconds: float = 10.0,
    memory_mb: int = 512,
    file_mb: int = 16,
    max_processes: int = 16,
    max_workers: int = 4,
    python: str | None = None,
) -> RewardFn:
    """A `code_tests` reward with these sandbox limits, per case: `cpu_seconds`, `wall_seconds`,
    `memory_mb` (address space), `file_mb` (any one file), `max_processes`. Cases run concurrently on
    `max_workers` threads (each a sandboxed process); once a case makes a sample unscorable its
    remaining cases are skipped. `python`: the interpreter inside the sandbox (default: this one)."""
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
        raise RewardError(f"code_tests: max_workers must be a positive integer, got {max_workers!r}")
    limits = dict(
        cpu_seconds=cpu_seconds,
        wall_seconds=wall_seconds,
        memory_bytes=int(memory_mb * 2**20),
        file_bytes=int(file_mb * 2**20),
        max_processes=max_processes,
        python=python,
    )

    def code_tests(prompts: list, completions: list, tests: list, **kwargs: Any) -> list[float | None]:
        """Fraction of the row's tests the completion's program passes; None where a run left the sandbox's limits."""
        if len(tests) != len(completions):
            raise ValueError(f"code_tests: {len(completions)} completions but {len(tests)} tests")
        cases = [parse_tests(value, index=i) for i, value in enumerate(tests)]
        programs = [extract_code(completion_text(c)) for c in completions]
        jobs = [(i, case) for i, sample_cases in enumerate(cases) for case in (sample_cases or [])]
        unscorable: set[int] = set()
        lock = threading.Lock()

        def run(job: tuple[int, CodeCase]) -> bool | None:
            i, case = job
            with lock:
                if i in unscorable:
                    return None  # a sibling case already made this sample unscorable
            result = run_sandboxed(programs[i], case.stdin, check=case.check, **limits)
            if not result.ok:
                with lock:
                    unscorable.add(i)
                return None
            return _passed(case, result)

        with ThreadPoolExecutor(max_workers=min(max_workers, max(len(jobs), 1))) as pool:
            outcomes = list(pool.map(run, jobs))
        passed = [0] * len(completions)
        for (i, _), outcome in zip(jobs, outcomes):
            passed[i] += bool(outcome)
        return [
            None if not sample_cases or i in unscorable else passed[i] / len(sample_cases)
            for i, sample_cases in enumerate(cases)
        ]

    code_tests.limits = limits  # type: ignore[attr-defined]  # shown in logs and errors
    return code_tests


code_tests = code_reward()
