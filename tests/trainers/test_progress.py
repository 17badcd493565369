"""The progress bar counts against the bound that ends the run: the time budget when it binds (GRPO's demo:
max_steps=800 in a 27-minute budget), the steps otherwise; its ETA follows that bound. A fake clock stands
in for the minutes."""

from __future__ import annotations

import io
import time

import pytest
import torch

from posttrain.config import load_config
from posttrain.trainers import loop, rl
from posttrain.trainers.loop import run_steps
from posttrain.trainers.progress import StepProgress, outlook
from posttrain.trainers.rl.config import GRPOConfig
from tests.trainers.rl_helpers import reward_file, tiny_model, tokenizer

BUDGET_S = 27 * 60


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_time_budget_binds_when_the_steps_would_take_longer():
    # 3 steps of 20 s after 10 s of setup: 997 more steps would take 5.5 hours, the budget ends in 25:50.
    view = outlook(done=3, max_steps=1000, elapsed_s=70.0, s_per_step=20.0, budget_s=BUDGET_S)
    assert view.bound == "time"
    assert view.remaining_s == BUDGET_S - 70.0
    assert view.last_step == 3 + int((BUDGET_S - 70.0) // 20.0) == 80


def test_the_end_of_the_budget_kept_for_the_final_evaluation_takes_no_step():
    # 1550 s left, of which 58 s (an evaluation of 40 s, x 1.2, + 10 s) follow the last step: 74 more steps.
    view = outlook(done=3, max_steps=1000, elapsed_s=70.0, s_per_step=20.0, budget_s=BUDGET_S, reserve_s=58.0)
    assert (view.bound, view.remaining_s, view.last_step) == ("time", BUDGET_S - 70.0, 3 + 74)
    # The last 7 steps of 10 s fit in the 100 s left, but not in the 42 s that the 58 s kept leave: the budget binds.
    assert outlook(3, 10, BUDGET_S - 100.0, 10.0, budget_s=BUDGET_S).bound == "steps"
    view = outlook(3, 10, BUDGET_S - 100.0, 10.0, budget_s=BUDGET_S, reserve_s=58.0)
    assert (view.bound, view.remaining_s, view.last_step) == ("time", 100.0, 3 + 4)


def test_the_steps_bind_when_they_end_first():
    view = outlook(done=3, max_steps=10, elapsed_s=40.0, s_per_step=10.0, budget_s=BUDGET_S)
    assert (view.bound, view.remaining_s, view.last_step) == ("steps", 70.0, 10)
    assert outlook(3, 10, 40.0, 10.0, budget_s=None).bound == "steps"  # no budget: steps alone
    assert outlook(3, 10, 40.0, 10.0, budget_s=float("inf")).remaining_s == 70.0


def test_before_the_first_step_there_is_no_eta():
    view = outlook(done=0, max_steps=1000, elapsed_s=5.0, s_per_step=None, budget_s=BUDGET_S)
    assert (view.bound, view.remaining_s, view.last_step) == ("steps", None, 1000)


def test_the_demo_bar_shows_the_minutes_and_the_budgets_eta():
    clock = Clock()
    started = clock.now
    clock.now += 10  # setup before the bar
    bar = StepProgress(1000, budget_s=BUDGET_S, desc="grpo (grpo)", started=started, clock=clock, file=io.StringIO())
    assert "0/1000 steps [00:10<?]" in bar.line()
    for step in (1, 2, 3):
        clock.now += 20
        bar.set_postfix_str("reward=0.412")
        bar.step_done(step)
    line = bar.line()
    # 70 s of 27 min: 4%; 1550 s left (25:50), not the 5:32:20 that 997 steps at 20 s would take.
    assert " 4%|" in line and "1.2/27 min [01:10<25:50, step 3 of ~80, 20.0 s/step, reward=0.412]" in line
    assert bar.outlook.bound == "time"
    bar.close()


def test_the_bar_switches_to_the_budget_when_the_pace_slows():
    clock = Clock()
    bar = StepProgress(100, budget_s=600.0, clock=clock, file=io.StringIO())
    clock.now += 5
    bar.step_done(1)  # 99 more steps at 5 s: 495 s, inside the 595 s left
    assert bar.outlook.bound == "steps" and "1/100 steps [00:05<08:15, 5.0 s/step]" in bar.line()
    clock.now += 15
    bar.step_done(2)  # now 10 s a step: 980 s of steps, but only 580 s of budget
    assert bar.outlook.bound == "time" and "0.3/10 min [00:20<09:40, step 2 of ~60" in bar.line()
    bar.close()


def test_a_resumed_run_paces_on_its_own_steps():
    clock = Clock()
    bar = StepProgress(1000, budget_s=BUDGET_S, start_step=500, clock=clock, file=io.StringIO())
    clock.now += 2
    bar.step_done(501)  # one step of 2 s: the 499 left take 998 s, inside the budget
    assert bar.outlook.s_per_step == 2.0 and "501/1000 steps [00:02<16:38" in bar.line()
    bar.close()


def test_run_steps_draws_the_steps_view(capsys):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    run_steps(lambda step: {"loss": 0.5, "tokens": 10}, max_steps=2, optimizer=optimizer, progress=True)
    assert "2/2 steps [" in capsys.readouterr().err


def test_fast_steps_show_their_pace():
    clock = Clock()
    bar = StepProgress(10, clock=clock, file=io.StringIO())
    clock.now += 0.034
    bar.step_done(1)
    assert "1/10 steps [00:00<00:00, 0.034 s/step]" in bar.line()
    bar.close()


def test_the_rl_loop_gives_the_bar_its_time_budget(tmp_path, monkeypatch):
    seen: list[StepProgress] = []

    class Recording(StepProgress):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.steps: list[int] = []
            seen.append(self)

        def step_done(self, done: int) -> None:
            super().step_done(done)
            self.steps.append(done)

    monkeypatch.setattr(loop, "StepProgress", Recording)  # the shared step loop draws the RL bar too
    tok = tokenizer()
    cfg = load_config(
        GRPOConfig,
        None,
        [
            f"out={tmp_path / 'run'}",
            f"reward.functions=[{reward_file(tmp_path)}:char_mix]",
            "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=4",
            "rollout.max_tokens=4",
            "data.eval_size=0",
            "train.max_steps=2",
            "train.max_minutes=5",
            "log.progress=false",
            "save_final=false",
        ],
    )
    before = time.perf_counter()
    rl.train_grpo(cfg, model=tiny_model(tok), tokenizer=tok)
    (bar,) = seen
    assert bar.budget_s == pytest.approx(300.0) and bar.max_steps == 2 and bar.steps == [1, 2]
    assert bar.reserve_s == 10.0  # no evaluation before (data.eval_size=0): the save's 10 s
    # The budget's clock is the loop's own: it started with train_grpo, before the setup.
    assert before <= bar.started <= before + 1.0
