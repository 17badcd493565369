"""The training progress bar, drawn against whichever bound will end the run.

A run stops at `max_steps` or when its time budget (RL's `train.max_minutes`) runs out, whichever comes
first. A bar that counted steps against `max_steps` alone would promise four hours for a run the budget
ends after 27 minutes. So after every step the bar works out, from the mean time a step has taken, which
bound arrives first (`outlook`), and draws that one:

    steps bind:  grpo:  30%|███       | 3/10 steps [00:30<01:10, 10.0 s/step, reward=0.412]
    time binds:  grpo:  41%|████      | 11.1/27 min [11:06<15:54, step 37 of ~90, 18.0 s/step, reward=0.412]

In the time view the bar fills with the minutes and the ETA is the budget left; the step count it reaches by
then is an estimate (`~`) at the present pace. Before the first step there is no pace, and the bar counts
steps without an ETA.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from tqdm.auto import tqdm


@dataclass(frozen=True)
class Outlook:
    """Where a run stands: which bound ends it, and when."""

    bound: Literal["steps", "time"]
    done: int  # steps finished
    last_step: int  # the step the run ends after: max_steps, or the steps the budget leaves room for
    elapsed_s: float  # on the budget's clock
    remaining_s: float | None  # until the run ends; None before the first step (no pace yet)
    s_per_step: float | None


def outlook(
    done: int,
    max_steps: int,
    elapsed_s: float,
    s_per_step: float | None,
    budget_s: float | None = None,
    reserve_s: float = 0.0,
) -> Outlook:
    """The bound that ends the run first, from the steps done, the pace so far and the budget.

    The steps bound ends it after (max_steps - done) more steps at `s_per_step`; the time bound after
    (budget_s - elapsed_s), of which the last `reserve_s` (the final evaluation and save) take no step.
    Without a pace only the steps are known."""
    if s_per_step is None or s_per_step <= 0:
        return Outlook("steps", done, max_steps, elapsed_s, None, None)
    by_steps = (max_steps - done) * s_per_step
    if budget_s is None or not math.isfinite(budget_s):
        return Outlook("steps", done, max_steps, elapsed_s, by_steps, s_per_step)
    by_time = max(budget_s - elapsed_s, 0.0)
    for_steps = max(by_time - reserve_s, 0.0)
    if by_steps <= for_steps:
        return Outlook("steps", done, max_steps, elapsed_s, by_steps, s_per_step)
    last = min(max_steps, done + int(for_steps // s_per_step))
    return Outlook("time", done, last, elapsed_s, by_time, s_per_step)


class StepProgress:
    """A tqdm bar over a run's steps that shows progress against the binding bound (see `outlook`).

    `started` is when the budget's clock started (default: now), `start_step` the steps a resumed run had
    already done, `reserve_s` the end of the budget kept for what follows the last step. The pace is the
    mean wall time per step since `mark_start()` (called by the constructor; call it again once the steps
    begin if something slow, an evaluation, comes between)."""

    def __init__(
        self,
        max_steps: int,
        *,
        budget_s: float | None = None,
        enabled: bool = True,
        desc: str = "train",
        start_step: int = 0,
        started: float | None = None,
        reserve_s: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
        file: Any = None,
    ) -> None:
        self.max_steps, self.budget_s, self.reserve_s, self.clock = max_steps, budget_s, reserve_s, clock
        self.started = clock() if started is None else started
        self.done = start_step
        self.mark_start()
        # Created with our format, so that its first line (tqdm draws one at once) is already ours.
        total, n, bar_format = self._layout(self.outlook)
        self._bar = tqdm(
            total=total, initial=n, desc=desc, disable=not enabled, dynamic_ncols=True, file=file, bar_format=bar_format
        )

    def mark_start(self) -> None:
        """Measure the pace from now and from the steps done so far."""
        self._pace_from, self._pace_steps = self.clock(), self.done

    @property
    def outlook(self) -> Outlook:
        steps = self.done - self._pace_steps
        s_per_step = (self.clock() - self._pace_from) / steps if steps > 0 else None
        return outlook(
            self.done, self.max_steps, self.clock() - self.started, s_per_step, self.budget_s, self.reserve_s
        )

    def step_done(self, done: int) -> None:
        """`done` steps are finished (the step number just logged)."""
        self.done = done
        self._draw()

    def set_postfix_str(self, text: str) -> None:
        """The trainer's headline metrics after the bar's own figures; drawn with the next `step_done`."""
        self._bar.set_postfix_str(text, refresh=False)

    def set_postfix(self, **values: str) -> None:
        self._bar.set_postfix(refresh=False, **values)

    def write(self, text: str) -> None:
        """A line of text above the bar (tqdm.write: the bar is redrawn below it)."""
        tqdm.write(text)

    def line(self) -> str:
        """The bar as it is drawn now (what the terminal shows), for logs and tests."""
        return str(self._bar)

    def close(self) -> None:
        self._bar.close()

    def _draw(self) -> None:
        if self._bar.disable:
            return
        self._bar.total, self._bar.n, self._bar.bar_format = self._layout(self.outlook)
        self._bar.refresh()

    def _layout(self, view: Outlook) -> tuple[float, float, str]:
        """(the bar's total, its position, its tqdm format) for `view`: steps, or minutes of the budget."""
        eta = tqdm.format_interval(view.remaining_s) if view.remaining_s is not None else "?"
        clock = f"{tqdm.format_interval(view.elapsed_s)}<{eta}"
        pace = ""
        if view.s_per_step is not None:  # 18.0 s/step; 0.034 s/step for fast steps
            pace = f", {view.s_per_step:.1f} s/step" if view.s_per_step >= 1 else f", {view.s_per_step:.2g} s/step"
        if view.bound == "time":
            assert self.budget_s is not None
            budget_min = self.budget_s / 60
            total, n = budget_min, min(view.elapsed_s / 60, budget_min)
            text = f"{view.elapsed_s / 60:.1f}/{budget_min:g} min [{clock}, step {view.done} of ~{view.last_step}{pace}"
        else:
            total, n = self.max_steps, view.done
            text = f"{view.done}/{self.max_steps} steps [{clock}{pace}"
        # tqdm fills in desc, percentage, bar and postfix (", <postfix>" when one is set); the rest is ours.
        escaped = text.replace("{", "{{").replace("}", "}}")
        return total, n, "{desc}: {percentage:3.0f}%|{bar}| " + escaped + "{postfix}]"
