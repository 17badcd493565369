"""Prompt sources for rollouts: a built-in task (`posttrain.tasks`) or a dataset with a prompt column.

A dataset is read through `posttrain.data.readers`, as every trainer's data: JSON Lines or a JSON array
(optionally gzipped; a file of any other name is read as JSON too), Parquet, Arrow, or a directory
written by `datasets`' `save_to_disk`. Errors name the file and line (or row).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from posttrain.data.readers import COLUMNAR_SUFFIXES, read_json_rows, read_rows, row_location
from posttrain.errors import PosttrainError
from posttrain.rollout.batch import PROMPT_KEY


class PromptSource(Protocol):
    reward: str  # the default reward spec for this data

    def sample(self, n: int) -> list[dict[str, Any]]: ...

    def held_out(self, n: int) -> list[dict[str, Any]]: ...

    def state_dict(self) -> dict[str, Any]: ...  # plain JSON: where sampling stands, for exact resume

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class PromptData(Protocol):
    """Where prompts come from (the RL config's `data:` section has these fields)."""

    task: str | None  # a posttrain.tasks.TASKS key; None: the dataset at `path`
    task_options: dict[str, Any]  # the task's options beside seed / path (empty for a dataset)
    path: str | None  # with a task: the task's data file; without: the dataset
    prompt_column: str
    prompt_template: str | None
    system_prompt: str | None
    seed: int
    eval_size: int  # rows held out (the last ones of a dataset)


def prompt_row(
    record: dict[str, Any],
    prompt_column: str,
    where: str,
    template: str | None = None,
    system_prompt: str | None = None,
) -> dict[str, Any]:
    """A dataset record as a rollout row: the prompt column becomes `prompt` (a string gets `template`,
    formatted with the record's columns, and `system_prompt`, and becomes a one-turn chat); the other
    columns stay for the reward functions. `where` (file:line) names the record in errors."""
    prompt = record[prompt_column]
    columns = {k: v for k, v in record.items() if k != prompt_column}
    if isinstance(prompt, str):
        try:
            text = template.format(**record) if template else prompt
        except (KeyError, IndexError, ValueError) as error:
            raise PosttrainError(
                f"{where}: prompt template {template!r} cannot be filled from this row "
                f"({type(error).__name__}: {error}; columns: {', '.join(record)})"
            ) from None
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        prompt = messages + [{"role": "user", "content": text}]
    elif not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m for m in prompt)):
        raise PosttrainError(f"{where}: column {prompt_column!r} must be a string or a list of chat messages")
    return {**columns, PROMPT_KEY: prompt}


def _dataset_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line or row number, record): Parquet, Arrow and saved HF datasets by `read_rows`; any other file
    as JSON Lines / a JSON array whatever its name (bad JSON / UTF-8: a DataError naming file:line:column)."""
    if path.is_dir() or path.name.lower().endswith(COLUMNAR_SUFFIXES):
        return read_rows(path)
    return read_json_rows(path)


class DatasetPrompts:
    """Rows of a dataset file; the prompt column becomes `prompt` (a string gets the template and system
    prompt and becomes a one-turn chat). The last `eval_size` rows are held out; training cycles over
    the rest in an order reshuffled each epoch."""

    reward = ""  # no default: `reward.functions` must name one

    def __init__(self, cfg: PromptData, whole_rows: bool = False) -> None:
        """`whole_rows`: a record without the prompt column is kept as it is, not refused (an environment makes
        the prompt from the row's columns when it opens an episode)."""
        path = Path(cfg.path or "").expanduser()
        if not (path.is_file() or path.is_dir()):
            raise PosttrainError(f"data.path: {path} not found")
        rows = []
        for number, record in _dataset_records(path):
            where = row_location(path, number)
            if whole_rows and cfg.prompt_column not in record:
                rows.append(dict(record))
                continue
            if cfg.prompt_column not in record:
                raise PosttrainError(
                    f"{where}: no prompt column {cfg.prompt_column!r} "
                    f"(columns: {', '.join(record) or 'none'}); set data.prompt_column"
                )
            rows.append(prompt_row(record, cfg.prompt_column, where, cfg.prompt_template, cfg.system_prompt))
        if len(rows) <= cfg.eval_size:
            raise PosttrainError(
                f"{path}: {len(rows)} rows, not enough for data.eval_size={cfg.eval_size} held out plus training rows"
            )
        split = len(rows) - cfg.eval_size
        self.train_rows, self.held_out_rows = rows[:split], rows[split:]
        self.rng = random.Random(cfg.seed)
        self.order: list[int] = []

    def sample(self, n: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(n):
            if not self.order:
                self.order = list(range(len(self.train_rows)))
                self.rng.shuffle(self.order)
            out.append(dict(self.train_rows[self.order.pop()]))
        return out

    def held_out(self, n: int) -> list[dict[str, Any]]:
        return [dict(row) for row in self.held_out_rows[:n]]

    def state_dict(self) -> dict[str, Any]:
        version, words, gauss = self.rng.getstate()
        return {"rng": [version, list(words), gauss], "order": list(self.order)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, words, gauss = state["rng"]
        order = [int(i) for i in state["order"]]
        if any(not 0 <= i < len(self.train_rows) for i in order):
            raise PosttrainError(
                f"prompt source state: row index out of range for {len(self.train_rows)} training "
                "rows (a different data file?)"
            )
        self.rng.setstate((version, tuple(words), gauss))
        self.order = order


def make_prompt_source(cfg: PromptData, whole_rows: bool = False) -> PromptSource:
    """A built-in task (its `path` option from data.path, if given) or a dataset (`whole_rows`: see
    DatasetPrompts)."""
    if cfg.task is None:
        return DatasetPrompts(cfg, whole_rows)
    from posttrain.tasks import make_task

    options: dict[str, Any] = {**cfg.task_options, "seed": cfg.seed}
    if cfg.path is not None:
        options["path"] = cfg.path
    if cfg.task == "gsm8k":
        options["held_out_size"] = max(cfg.eval_size, 1)
    return make_task(cfg.task, **options)


def data_columns(source: PromptSource, need_prompt: bool = True) -> list[str]:
    """The data's columns a reward function receives: every row key but the prompt (`need_prompt`: the rows
    must have one)."""
    first = (source.held_out(1) or source.sample(1))[0]
    if need_prompt and PROMPT_KEY not in first:
        raise PosttrainError(f"the data's rows have no {PROMPT_KEY!r} (columns: {', '.join(first)})")
    return [k for k in first if k != PROMPT_KEY]


def check_prompt_lengths(source: PromptSource, held_out: list[dict[str, Any]], tokenizer: Any, limit: int) -> None:
    """Every prompt the run can draw (a task's or dataset's training rows when it exposes them, and the
    held-out rows) must fit `rollout.max_prompt_tokens` once templated; else fail now, naming the row."""
    rows = list(getattr(source, "train_rows", [])) + list(held_out)
    for index, row in enumerate(rows):
        ids = tokenizer.apply_chat_template(list(row[PROMPT_KEY]), add_generation_prompt=True, tokenize=True)
        if len(ids) > limit:
            where = f"training row {index}" if index < len(rows) - len(held_out) else "a held-out row"
            raise PosttrainError(
                f"data: {where} has a prompt of {len(ids)} tokens, more than "
                f"rollout.max_prompt_tokens={limit}; raise it (or drop long rows)"
            )
