"""The word_problems environment: one operation per `calculate` call, results carried forward, exact reward;
and its SFT transcripts replay through it."""

from __future__ import annotations

import json

import pytest

from posttrain.envs.builtin_tools import calculate
from posttrain.envs.loading import load_environment_factory
from posttrain.envs.tool_calls import parse_hermes
from posttrain.envs.transcripts import main, word_problem_transcripts
from posttrain.envs.word_problems import SYSTEM_PROMPT, WordProblemsEnvironment
from posttrain.tasks import make_task

pytest.importorskip("transformers")

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "%s"}}\n</tool_call>'


@pytest.mark.parametrize(
    ("expression", "answer"),
    [("347 * 29", "10063"), ("1636 - 981", "655"), ("84 / 4", "21"), ("-5 + 2", "-3"), ("7", "7")],
)
def test_calculate_computes_one_operation(expression, answer):
    assert calculate(expression) == answer


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("(509 - 471) * 10", "one operation per call ('(509 - 471) * 10' has 2)"),
        ("1 + 2 + 3 + 4", "has 3"),
        ("2 +", "cannot parse"),
        ("x * 2", "unsupported element"),
    ],
)
def test_calculate_refuses_chains_and_bad_expressions_with_a_reason(expression, error):
    result = calculate(expression)
    assert result.startswith("Error: ") and error in result


def test_an_episode_chains_the_results_and_scores_the_exact_answer():
    row = make_task("word_problems", seed=1).sample(1)[0]
    env = WordProblemsEnvironment()
    assert env.reset(row) == [{"role": "system", "content": SYSTEM_PROMPT}, *row["prompt"]]
    assert [tool.name for tool in env.tools] == ["calculate"]
    value = row["start"]
    for op, n in row["chain"]:
        step = env.step(parse_hermes(CALL % f"{value} {op} {n}"))
        assert not step.done and step.counts["tool_calls"] == 1
        value = int(step.observations[0]["content"])
    assert str(value) == row["answer"]
    assert env.step(parse_hermes(f"The answer is {value}.")).done and env.episode_reward() == 1.0


def test_a_whole_chain_in_one_call_is_refused_and_a_wrong_answer_scores_zero():
    row = {"prompt": "A shop has 509 cards. ...", "answer": "4940"}
    env = WordProblemsEnvironment()
    env.reset(row)
    step = env.step(parse_hermes(CALL % "(509 - 471) * 10 * 13"))
    assert step.observations[0]["content"].startswith("Error: one operation per call")
    assert env.step(parse_hermes("The answer is 4941.")).done and env.episode_reward() == 0.0
    cut_short = WordProblemsEnvironment()
    cut_short.reset(row)
    assert cut_short.episode_reward() == 0.0  # never answered: no credit


def test_the_environment_loads_by_name_with_its_options():
    make = load_environment_factory("word_problems", options={"tool_timeout_s": 2.0})
    assert make().tool_timeout_s == 2.0
    with pytest.raises(Exception, match="has its own tools"):
        load_environment_factory("word_problems", tools=["python"])


def test_transcripts_replay_through_the_environment_step_for_step():
    records = word_problem_transcripts(6, seed=2)
    assert {len(r["messages"]) for r in records} <= {2 + 2 * k + 1 for k in (2, 3, 4)}
    for record in records:
        messages = record["messages"]
        env = WordProblemsEnvironment()
        row = {"prompt": messages[1:2], "answer": messages[-1]["content"].split()[-1].rstrip(".")}
        assert env.reset(row) == messages[:2]
        for index, (call, result) in enumerate(zip(messages[2:-1:2], messages[3:-1:2])):
            function = call["tool_calls"][0]["function"]
            turn = parse_hermes(f"<tool_call>\n{json.dumps(function)}\n</tool_call>", index)  # ids count on
            assert function["name"] == "calculate" and env.step(turn).observations == [result]
        assert env.step(parse_hermes(messages[-1]["content"])).done and env.episode_reward() == 1.0
    # each call's first operand is the previous call's result
    messages = records[0]["messages"]
    calls = [m["tool_calls"][0]["function"]["arguments"]["expression"] for m in messages[2:-1:2]]
    results = [m["content"] for m in messages[3:-1:2]]
    assert [c.split()[0] for c in calls[1:]] == results[:-1]


def test_the_transcript_command_filters_by_operations(tmp_path, capsys):
    out = tmp_path / "wp.jsonl"
    main(["--env", "word_problems", "--out", str(out), "--rows", "5", "--operations", "3"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 5 and all(len(r["messages"]) == 2 + 2 * 3 + 1 for r in rows)
    main(["--env", "word_problems", "--out", str(out), "--rows", "6", "--operations", "2", "4", "--seed", "1"])
    mixed = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(len(r["messages"]) - 3) // 2 for r in mixed] == [2, 4, 2, 4, 2, 4]  # interleaved, 3 of each
    assert mixed[1::2] == word_problem_transcripts(3, seed=1 + 4, operations=4)  # count k from seed + k
    for argv, error in [
        (["--operations", "3"], "applies to --env word_problems"),
        (["--env", "word_problems", "--operations", "5"], "must be 2 to 4"),
        (["--env", "word_problems", "--rows", "5", "--operations", "2", "3"], "must split evenly"),
        (["--env", "word_problems", "--rows", "4", "--operations", "3", "3"], "must split evenly over distinct"),
    ]:
        with pytest.raises(SystemExit):
            main(["--out", str(out), *argv])
        assert error in capsys.readouterr().err


def test_the_demo_s_cold_start_data_is_what_its_command_writes_and_fits():
    """examples/agent_word_problems_sft.yaml trains on the 8 two-step rows its header's command writes, each row
    four times, within its max_length in the default model's tokenizer."""
    from pathlib import Path

    from posttrain.chat_templates import load_chat_template
    from posttrain.config import load_config
    from posttrain.data.formats import parse_conversational
    from posttrain.data.tokenize import tokenize_sft
    from posttrain.trainers.sft import SFTConfig
    from tests.trainers.rl_helpers import tokenizer as default_tokenizer

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(SFTConfig, root / "examples" / "agent_word_problems_sft.yaml")
    records = [json.loads(line) for line in (root / cfg.data.path).read_text().splitlines()]
    assert records == word_problem_transcripts(8, seed=0, operations=2)
    assert 4 * len(records) == cfg.train.batch_size * cfg.train.max_steps
    tok = default_tokenizer()
    tok.chat_template = load_chat_template(cfg.model.chat_template)
    lengths = [len(tokenize_sft(tok, parse_conversational(r)).input_ids) for r in records]
    assert max(lengths) <= cfg.data.max_length


def test_step_reward_credits_each_next_intermediate_once_and_in_order():
    row = {
        "prompt": [{"role": "user", "content": "A shop has 100 cards. ..."}],
        "answer": "36",
        "start": 100,
        "chain": [["+", 20], ["/", 4], ["+", 6]],  # 120, 30, 36
    }
    env = load_environment_factory("word_problems", options={"step_reward": 0.25})()
    env.reset(row)
    first = env.step(parse_hermes(CALL % "100 + 20"))
    assert (first.reward, first.counts["correct_steps"]) == (0.25, 1.0)
    again = env.step(parse_hermes(CALL % "100 + 20"))  # the same step again: 120 is no longer the next value
    assert (again.reward, again.counts["correct_steps"]) == (0.0, 0.0)
    skipped = env.step(parse_hermes(CALL % "30 + 6"))  # 36 is the third value, not the second
    assert skipped.reward == 0.0
    assert env.step(parse_hermes(CALL % "120 / 4")).reward == 0.25
    final = env.step(parse_hermes("The answer is 36."))
    assert final.done and final.reward == 0.0 and env.episode_reward() == 1.0
    # off by default: counted, not rewarded; rows without a chain (the shipped test file) neither
    plain = load_environment_factory("word_problems")()
    plain.reset(row)
    step = plain.step(parse_hermes(CALL % "100 + 20"))
    assert step.reward is None and step.counts["correct_steps"] == 1.0
    plain.reset({"prompt": "q", "answer": "3"})
    assert "correct_steps" not in plain.step(parse_hermes(CALL % "1 + 2")).counts
    with pytest.raises(Exception, match=r"step_reward must be a number in \[0, 1\], got 2"):
        load_environment_factory("word_problems", options={"step_reward": 2})


def test_extra_call_penalty_charges_each_call_past_the_chain_length():
    row = {"prompt": [{"role": "user", "content": "q"}], "answer": "30", "start": 100, "chain": [["+", 20], ["/", 4]]}
    options = {"step_reward": 0.1, "extra_call_penalty": 0.25}
    env = load_environment_factory("word_problems", options=options)()
    env.reset(row)
    rewards = [env.step(parse_hermes(CALL % e)) for e in ("100 + 20", "7 * 7", "120 / 4", "30 / 3")]
    # the second call is wrong but within the two the problem needs; the third (right) and fourth are past them
    assert [s.reward for s in rewards] == [0.1, 0.0, 0.1 - 0.25, -0.25]
    assert [s.counts["extra_calls"] for s in rewards] == [0.0, 0.0, 1.0, 1.0]
    two_at_once = parse_hermes((CALL % "100 + 20") + "\n" + (CALL % "120 / 4") + "\n" + (CALL % "30 + 1"))
    env.reset(row)  # a new episode: the count starts over; three calls in one turn, one past the chain
    step = env.step(two_at_once)
    assert len(step.observations) == 3 and step.counts["extra_calls"] == 1.0
    assert step.reward == pytest.approx(0.2 - 0.25)
    # off by default (counted only), and refused outside [0, 1]
    plain = load_environment_factory("word_problems", options={"step_reward": 0.1})()
    plain.reset(row)
    for e in ("100 + 20", "120 / 4", "30 / 3"):
        last = plain.step(parse_hermes(CALL % e))
    assert last.reward == 0.0 and last.counts["extra_calls"] == 1.0
    with pytest.raises(Exception, match=r"extra_call_penalty must be a number in \[0, 1\], got -1"):
        load_environment_factory("word_problems", options={"extra_call_penalty": -1})
