"""RL tasks: sources of prompts with reference answers, chosen by name in the trainer config.

task = make_task("arithmetic", seed=0)      # or TASKS["arithmetic"](seed=0)
rows = task.sample(64)                      # [{"prompt": [...messages], "answer": "85"}, ...]
reward_fn = load_reward(task.reward)        # posttrain.rewards spec, e.g. "numeric_match"
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from posttrain.tasks.arithmetic import ArithmeticTask
from posttrain.tasks.base import Task, TaskError, accuracy
from posttrain.tasks.gsm8k import GSM8KTask, load_gsm8k
from posttrain.tasks.guess_number import GuessNumberTask
from posttrain.tasks.multiplication import MultiplicationTask
from posttrain.tasks.word_problems import WordProblemsTask

TASKS: dict[str, Callable[..., Task]] = {
    "arithmetic": ArithmeticTask,
    "gsm8k": GSM8KTask,
    "multiplication": MultiplicationTask,
    "guess_number": GuessNumberTask,  # rows for the guess_number environment, which scores them itself
    "word_problems": WordProblemsTask,  # 2-4 chained steps, for the word_problems environment's calculator
}

# Built-in tasks and the reward each is scored with unless `reward.functions` says otherwise.
TASK_DEFAULT_REWARDS: dict[str, str] = {
    "arithmetic": "numeric_match",
    "gsm8k": "gsm8k",
    "multiplication": "numeric_match",
    "word_problems": "numeric_match",
}


def make_task(name: str, **options: Any) -> Task:
    """The task registered under `name`, built with `options` (an unknown name or option is a TaskError)."""
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r} (choose from {', '.join(TASKS)})")
    factory = TASKS[name]
    try:
        inspect.signature(factory).bind(**options)
    except TypeError as error:
        accepted = ", ".join(inspect.signature(factory).parameters)
        raise TaskError(f"task {name!r}: {error} (options: {accepted})") from None
    return factory(**options)


__all__ = [
    "TASKS",
    "TASK_DEFAULT_REWARDS",
    "ArithmeticTask",
    "GSM8KTask",
    "GuessNumberTask",
    "MultiplicationTask",
    "Task",
    "TaskError",
    "WordProblemsTask",
    "accuracy",
    "load_gsm8k",
    "make_task",
]
