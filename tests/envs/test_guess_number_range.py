"""guess_number with `show_range`: the range the answers allow, stated in each answer and tracked for the
out-of-range count; and the random-in-range player's SFT transcripts, which replay through the environment."""

from __future__ import annotations

import json

import pytest

from posttrain.envs.environment import EnvError
from posttrain.envs.guess_number import SYSTEM_PROMPT, GuessNumberEnvironment
from posttrain.envs.tool_calls import parse_hermes
from posttrain.envs.transcripts import guess_number_transcripts, main
from posttrain.tasks import GuessNumberTask


def test_the_range_narrows_with_each_answer_and_is_stated():
    env = GuessNumberEnvironment(max_turns=5, show_range=True)
    opening = env.reset({"prompt": "guess", "secret": 40})
    assert opening[0] == {"role": "system", "content": SYSTEM_PROMPT}
    replies = [env.step(parse_hermes(guess)).observations[0]["content"] for guess in ("50", "20", "60", "45")]
    assert replies == [
        "Lower. It is between 1 and 49. 4 guesses left.",
        "Higher. It is between 21 and 49. 3 guesses left.",
        "Lower. It is between 21 and 49. 2 guesses left.",  # 60 was already ruled out: the range stays
        "Lower. It is between 21 and 44. 1 guesses left.",
    ]
    assert env.step(parse_hermes("40")).done and env.episode_reward() == 1.0


def test_out_of_range_guesses_are_counted_with_or_without_the_stated_range():
    for show_range in (False, True):
        env = GuessNumberEnvironment(show_range=show_range)
        env.reset({"prompt": "guess", "secret": 7, "low": 1, "high": 10})
        counts = [env.step(parse_hermes(guess)).counts["out_of_range_guesses"] for guess in ("12", "5", "3", "x")]
        assert counts == [1.0, 0.0, 1.0, 0.0]  # 12 > high; 3 after "Higher" on 5; no number is invalid, not out
        assert "between" in env.step(parse_hermes("9")).observations[0]["content"] or not show_range


def test_a_row_s_range_starts_the_game_and_bad_rows_are_named():
    env = GuessNumberEnvironment(show_range=True)
    env.reset({"prompt": "guess", "secret": 15, "low": 10, "high": 20})
    assert env.step(parse_hermes("12")).observations[0]["content"].startswith("Higher. It is between 13 and 20.")
    with pytest.raises(EnvError, match="secret 30 is outside \\[10, 20\\]"):
        env.reset({"prompt": "guess", "secret": 30, "low": 10, "high": 20})
    with pytest.raises(EnvError, match="the row's 'low' must be an integer, got '1'"):
        env.reset({"prompt": "guess", "secret": 3, "low": "1"})
    with pytest.raises(EnvError, match="show_range must be true or false, got 'yes'"):
        GuessNumberEnvironment(show_range="yes")  # type: ignore[arg-type]


def test_transcripts_guess_within_the_range_and_replay_through_the_environment():
    records = guess_number_transcripts(40, seed=3, max_turns=7, show_range=True)
    won = 0
    for record, row in zip(records, GuessNumberTask(seed=3).sample(40)):  # the games' training secrets
        messages = record["messages"]
        assert messages[0]["role"] == "system" and messages[-1]["role"] == "assistant"
        env = GuessNumberEnvironment(7, show_range=True)
        assert env.reset(row) == messages[:2]
        for guess, answer in zip(messages[2::2], [*messages[3::2], None]):
            low, high = env.game.low, env.game.high
            assert low <= int(guess["content"]) <= high  # the player never wastes a guess
            step = env.step(parse_hermes(guess["content"]))
            assert step.observations[0] == answer or step.done
        won += env.episode_reward()
    # a uniform pick within the range solves about half of the 1..100 games in 7 guesses (51% over many games)
    assert 0.3 <= won / len(records) <= 0.75
    assert guess_number_transcripts(40, seed=3, max_turns=7, show_range=True) == records  # seeded


def test_the_transcript_command_writes_guess_number_games(tmp_path, capsys):
    out = tmp_path / "gn.jsonl"
    main(["--env", "guess_number", "--out", str(out), "--rows", "3", "--max-turns", "5", "--show-range"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == guess_number_transcripts(3, seed=0, max_turns=5, show_range=True)
    assert all(len(r["messages"]) <= 2 + 2 * 5 - 1 for r in rows)
    for argv, error in [
        (["--show-range"], "apply to --env guess_number"),
        (["--env", "word_problems", "--max-turns", "3"], "apply to --env guess_number"),
        (["--env", "guess_number", "--max-turns", "0"], "--max-turns must be positive"),
    ]:
        with pytest.raises(SystemExit):
            main(["--out", str(out), *argv])
        assert error in capsys.readouterr().err


def test_the_demo_s_cold_start_and_test_games_are_what_their_commands_write():
    """examples/agent_guess_number_sft.yaml trains on the 64 games its header's command writes, twice, within its
    max_length; the test file is the task's 200 held-out games of seed 1, played in the GRPO config's game."""
    from pathlib import Path

    from posttrain.chat_templates import load_chat_template
    from posttrain.config import load_config
    from posttrain.data.formats import parse_conversational
    from posttrain.data.tokenize import tokenize_sft
    from posttrain.trainers.rl.config import GRPOConfig
    from posttrain.trainers.sft import SFTConfig
    from tests.trainers.rl_helpers import tokenizer as default_tokenizer

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(SFTConfig, root / "examples" / "agent_guess_number_sft.yaml")
    records = [json.loads(line) for line in (root / cfg.data.path).read_text().splitlines()]
    assert records == guess_number_transcripts(64, seed=0, max_turns=7, show_range=True)
    assert 2 * len(records) == cfg.train.batch_size * cfg.train.max_steps
    tok = default_tokenizer()
    tok.chat_template = load_chat_template(cfg.model.chat_template)
    assert max(len(tokenize_sft(tok, parse_conversational(r)).input_ids) for r in records) <= cfg.data.max_length
    rl = load_config(GRPOConfig, root / "examples" / "agent_guess_number.yaml")
    assert rl.env.options == {"max_turns": 7, "show_range": True} and rl.model.name_or_path == cfg.out + "/final"
    test = [json.loads(line) for line in (root / "examples/data/guess_number/test.jsonl").read_text().splitlines()]
    assert test == GuessNumberTask().held_out(200, seed=1)
