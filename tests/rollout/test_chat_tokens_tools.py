"""Template deltas with the default tokenizer, the `chatml_tools` template and a real calculator episode: a model
that writes its turns as the template writes them gets exactly the template's tokens for the whole conversation,
and the hermes parser reads its tool call back."""

from __future__ import annotations

from posttrain.chat_templates import load_chat_template
from posttrain.envs.calculator import calculator_environment
from posttrain.envs.tool_calls import get_tool_call_parser
from posttrain.envs.transcripts import calculator_transcript
from posttrain.rollout.chat_tokens import ChatTokens
from tests.trainers.rl_helpers import tokenizer


def test_a_calculator_episode_grows_into_the_template_s_tokens() -> None:
    tok = tokenizer()
    tok.chat_template = load_chat_template("chatml_tools")
    env = calculator_environment()
    schemas = [tool.schema for tool in env.tools]
    row = {"prompt": [{"role": "user", "content": "What is 347 times 29?"}], "answer": "10063"}
    conversation = calculator_transcript(row)["messages"]
    chat = ChatTokens(tok, schemas)
    end = "<|im_end|>"
    (end_id,) = tok.encode(end)

    messages = env.reset(row)
    assert messages == conversation[:2]
    ids = chat.opening_ids(messages)
    parse = get_tool_call_parser("hermes")
    for index, wanted in enumerate(conversation[2:], start=2):
        if wanted["role"] != "assistant":
            continue
        # the turn as the template writes it, as a model that learned the format samples it
        before = chat.render(conversation[:index], add_generation_prompt=True)
        text = chat.render(conversation[: index + 1], add_generation_prompt=False)[len(before) :]
        text = text[: text.rindex(end)]
        ids += tok.encode(text) + [end_id]
        turn = parse(text, first_call_index=0)
        messages.append(turn.as_message())
        step = env.step(turn)
        if step.done:
            break
        assert [call.name for call in turn.tool_calls] == ["calculator"] and step.counts["tool_calls"] == 1
        ids += chat.observation_ids(messages, step.observations, end)
        messages += step.observations
    assert env.episode_reward() == 1.0
    whole = tok.apply_chat_template(conversation, add_generation_prompt=False, tools=schemas)
    assert ids == whole[: len(ids)] and tok.decode(whole[len(ids) :]) == "\n"
