"""Calculator SFT transcripts: the environment's own episode, and rows posttrain's SFT reads and masks as is."""

from __future__ import annotations

import json

import pytest

from posttrain.chat_templates import load_chat_template
from posttrain.data.formats import detect_format, parse_conversational
from posttrain.data.tokenize import IGNORE_INDEX, tokenize_sft
from posttrain.envs.calculator import calculator_environment
from posttrain.envs.tool_calls import parse_hermes
from posttrain.envs.transcripts import calculator_transcripts, main
from posttrain.tasks.multiplication import HELD_OUT_PAIRS
from tests.data.tiny import tiny_tokenizer

pytest.importorskip("transformers")


def test_a_transcript_is_the_solved_episode():
    (record,) = calculator_transcripts(1, seed=4)
    messages = record["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    a, b = (int(x) for x in messages[3 - 1]["tool_calls"][0]["function"]["arguments"]["expression"].split(" * "))
    assert messages[3]["content"] == str(a * b) and messages[4]["content"] == f"The answer is {a * b}."
    assert (a, b) not in HELD_OUT_PAIRS
    assert [tool["function"]["name"] for tool in record["tools"]] == ["calculator"]
    # replaying the transcript's assistant turns through the environment reproduces it and earns the reward
    env = calculator_environment()
    row = {"prompt": messages[1:2], "answer": str(a * b)}
    assert env.reset(row) == messages[:2]
    step = env.step(parse_hermes(f"<tool_call>\n{json.dumps(messages[2]['tool_calls'][0]['function'])}\n</tool_call>"))
    assert step.observations == [messages[3]]
    assert env.step(parse_hermes(messages[4]["content"])).done and env.episode_reward() == 1.0


def test_sft_reads_the_rows_and_trains_on_the_assistant_turns_only():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = load_chat_template("chatml_tools")
    record = json.loads(json.dumps(calculator_transcripts(1, seed=1)[0]))  # through JSON, as from the file
    assert detect_format(record) == "conversational"
    example = parse_conversational(record)
    assert example.tools == record["tools"]
    row = tokenize_sft(tokenizer, example)
    text = tokenizer.decode(row.input_ids)
    assert "<tools>" in text  # the tools column reached the template
    trained = tokenizer.decode([t for t, label in zip(row.input_ids, row.labels) if label != IGNORE_INDEX])
    answer = record["messages"][3]["content"]
    assert trained == (
        f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": '
        f'"{record["messages"][2]["tool_calls"][0]["function"]["arguments"]["expression"]}"}}}}\n</tool_call><|im_end|>\n'
        f"The answer is {answer}.<|im_end|>\n"
    )


def test_the_command_writes_jsonl(tmp_path, capsys):
    out = tmp_path / "sft.jsonl"
    main(["--out", str(out), "--rows", "3", "--seed", "2"])
    lines = out.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0]) == calculator_transcripts(3, seed=2)[0]
    assert "wrote 3 transcripts" in capsys.readouterr().out


def test_the_demo_s_cold_start_data_is_what_its_command_writes_and_fits():
    """examples/agent_calculator_sft.yaml trains on examples/data/calculator/sft.jsonl: the rows
    `python -m posttrain.envs.transcripts --rows 48 --seed 0` writes, enough for its steps without repeating a row,
    within its max_length in the default model's tokenizer."""
    from pathlib import Path

    from posttrain.config import load_config
    from posttrain.trainers.sft import SFTConfig
    from tests.trainers.rl_helpers import tokenizer as default_tokenizer

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(SFTConfig, root / "examples" / "agent_calculator_sft.yaml")
    records = [json.loads(line) for line in (root / cfg.data.path).read_text().splitlines()]
    assert records == calculator_transcripts(48, seed=0)
    assert len(records) >= cfg.train.batch_size * cfg.train.max_steps
    tok = default_tokenizer()
    tok.chat_template = load_chat_template(cfg.model.chat_template)
    lengths = [len(tokenize_sft(tok, parse_conversational(r)).input_ids) for r in records]
    assert max(lengths) <= cfg.data.max_length
