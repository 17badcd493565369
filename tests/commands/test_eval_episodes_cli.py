"""`posttrain eval accuracy --config RL.yaml`: rows played as greedy episodes in the config's environment (a
user's environment class from a file, on a tiny model that ends its turns), accuracy from the episodes' rewards."""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.cli import main
from posttrain.models.checkpoint_io import save_hf_dir
from tests.data.tiny import tiny_tokenizer
from tests.rollout.episode_helpers import turn_ending_model

ENV_SOURCE = '''
from posttrain.envs import EnvStep


class EvenAnswers:
    """Two turns: a tool result, then done; reward 1 when the row's answer is even (whatever the model wrote)."""

    tools = []

    def reset(self, row):
        self.row, self.turns = row, 0
        return list(row["prompt"])

    def step(self, turn):
        self.turns += 1
        if self.turns == 2:
            return EnvStep(done=True, counts={"tool_calls": 1, "tool_calls/probe": 1})
        return EnvStep([{"role": "tool", "content": "42"}], None, False, {"tool_calls": 1, "tool_calls/probe": 1})

    def episode_reward(self):
        return float(int(self.row["answer"]) % 2 == 0)
'''


def test_eval_accuracy_plays_the_config_s_environment(capsys, tmp_path: Path) -> None:
    model = save_hf_dir(turn_ending_model(eos_boost=12.0), tmp_path / "model", tokenizer=tiny_tokenizer())
    (tmp_path / "even.py").write_text(ENV_SOURCE)
    config = tmp_path / "rl.yaml"
    config.write_text(f"env:\n  name: {tmp_path / 'even.py'}:EvenAnswers\n  max_turns: 3\nrollout:\n  max_tokens: 8\n")
    data = tmp_path / "problems.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"What is {a} plus 1?", "answer": str(a + 1)}) + "\n" for a in range(5))
    )
    argv = ["eval", "accuracy", "--config", str(config), "--model", str(model), "--data", str(data), "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["accuracy"] == 2 / 5 and out["problems"] == 5  # answers 1..5: 2 and 4 are even
    assert out["env/turns"] == 2.0 and out["env/tool_calls/probe"] == 2.0 and out["env/truncated_frac"] == 0.0
    assert main(["eval", "accuracy", "--config", str(config), "--model", str(model), "--data", str(data)]) == 0
    assert capsys.readouterr().out.startswith("accuracy 0.4000")


def test_a_config_without_env_is_one_line(capsys, tmp_path: Path) -> None:
    config = tmp_path / "rl.yaml"
    config.write_text("rollout:\n  max_tokens: 8\n")
    assert main(["eval", "accuracy", "--config", str(config), "--data", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no env: section" in err[0]


def test_an_environment_that_scores_itself_needs_no_answer_column(capsys, tmp_path: Path) -> None:
    """guess_number rows ({"prompt", "secret"}) have no reference answer: the games are played and scored."""
    model = save_hf_dir(turn_ending_model(eos_boost=12.0), tmp_path / "model", tokenizer=tiny_tokenizer())
    config = tmp_path / "rl.yaml"
    config.write_text(
        "env:\n  name: guess_number\n  options: {max_turns: 2}\n  max_turns: 3\nrollout:\n  max_tokens: 4\n"
    )
    data = tmp_path / "games.jsonl"
    data.write_text("".join(json.dumps({"prompt": "Guess a number.", "secret": s}) + "\n" for s in (3, 7)))
    argv = ["eval", "accuracy", "--config", str(config), "--model", str(model), "--data", str(data), "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["problems"] == 2 and out["env/guesses"] == 2.0  # the budget of 2 guesses, played to its end
    data.write_text(json.dumps({"question_text": "Guess.", "secret": 3}) + "\n")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no prompt column 'prompt'" in err[0]
