"""Multi-turn episodes on the engine: the token sequence is the conversation as the template writes it, the
mask covers exactly the model's tokens, turns 2+ reuse the episode's cached blocks, environment calls are
bounded, limits truncate, and the seed alone decides an episode."""

from __future__ import annotations

import math

import pytest

from posttrain.errors import PosttrainError
from posttrain.rollout.chat_tokens import ChatTokens
from posttrain.rollout.episode_batch import EpisodeLog, episode_metrics, episodes_to_batch
from posttrain.rollout.scoring import score_groups
from tests.data.tiny import tiny_tokenizer
from tests.rollout.episode_helpers import EOS, ROWS, ScriptedEnv, make_llm, runner


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, value) of each maximal run of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


def test_template_deltas_give_the_template_applied_to_the_whole_conversation() -> None:
    # Model turns written as the tokenizer would encode their text (+ the end-of-turn token): the episode's
    # ids are then exactly the template applied to the full conversation, token for token.
    tok = tiny_tokenizer()
    chat = ChatTokens(tok)
    messages = [{"role": "user", "content": "What is two plus three?"}]
    ids = chat.opening_ids(messages)
    assert ids == tok.apply_chat_template(messages, add_generation_prompt=True)
    model_ids = []
    for turn, observation in [("Two plus", "five"), ("The answer is 42.", None)]:
        sampled = tok.encode(turn) + [EOS]
        ids += sampled
        model_ids.append(sampled)
        messages.append({"role": "assistant", "content": turn})
        if observation is not None:
            new = [{"role": "tool", "content": observation}]
            ids += chat.observation_ids(messages, new, tok.decode([EOS]))
            messages += new
    whole = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert ids == whole[: len(ids)] and tok.decode(whole[len(ids) :]) == "\n", "all but ChatML's tail after the end"


def test_a_template_that_rewrites_history_is_refused() -> None:
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}"
    chat = ChatTokens(tok)
    with pytest.raises(PosttrainError, match="only appends"):
        chat.observation_ids(
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            [{"role": "tool", "content": "c"}],
            "",
        )


def test_an_episode_is_what_the_model_saw_and_the_mask_is_the_model_s_tokens() -> None:
    llm = make_llm()
    play = runner(llm)
    episodes, _ = play.run(ROWS * 2, [1, 2, 3, 4])
    multi = [e for e in episodes if e.num_turns >= 2]
    assert multi, "the scripted episodes take several turns"
    for e in episodes:
        assert len(e.ids) == len(e.model_mask) == len(e.logprobs)
        turns = [r for r in _runs(e.model_mask) if r[2] == 1]
        assert len(turns) == e.num_turns == len(e.policy_versions)
        if e.finish == "done":
            # every model turn ends with its end-of-turn token, and the sequence decodes to the template's text
            assert all(e.ids[end - 1] == EOS for _, end, _ in turns)
            text = llm.tokenizer.decode(e.prompt_ids + e.ids, skip_special_tokens=False)
            assert play.chat.render(e.messages, add_generation_prompt=False) == text + "\n"
        # each observation run is the template delta of its messages, computed afresh
        observations = [m for m in e.messages[e.num_opening :] if m["role"] == "tool"]
        runs = [r for r in _runs(e.model_mask) if r[2] == 0]
        assert len(runs) == len(observations)
        history = list(e.messages[: e.num_opening])
        for (start, end, _), message in zip(runs, observations):
            history = e.messages[: e.messages.index(message)]
            assert e.ids[start:end] == play.chat.observation_ids(history, [message], "<|im_end|>")
        assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.model_mask) if m == 0)
        assert all(lp < 0.0 for lp, m in zip(e.logprobs, e.model_mask) if m == 1)


@pytest.mark.parametrize("caching", [True, False])
def test_turns_after_the_first_reuse_the_episode_s_cached_blocks(caching: bool) -> None:
    llm = make_llm(enable_prefix_caching=caching)
    episodes, _ = runner(llm).run(ROWS, [5, 6])
    block = llm.engine.config.block_size
    for e in episodes:
        # Turn k's request re-feeds everything before it; the blocks the previous turn's sequence filled (all but
        # its last, sampled token's K/V was computed) are in the cache, untouched by any weight update.
        expected = 0
        turns = [r for r in _runs(e.model_mask) if r[2] == 1]
        for (_, previous_end, _), (start, _, _) in zip(turns, turns[1:]):
            expected += (len(e.prompt_ids) + previous_end - 1) // block * block
            assert start > previous_end
        assert len(turns) >= 2
        assert e.reused_tokens >= expected > 0 if caching else e.reused_tokens == 0
    metrics = episode_metrics(EpisodeLog(episodes))
    assert (metrics["prefix_cache/reused_frac"] > 0.5) == caching


def test_an_environment_step_past_its_bound_ends_the_episode_truncated() -> None:
    llm = make_llm()
    episodes, timing = runner(llm, env=lambda: ScriptedEnv(sleep=30.0), step_timeout_s=0.3).run(ROWS, [1, 2])
    assert timing.wall_s < 30.0, "the rollout must not wait for the slow step"
    for e in episodes:
        assert e.finish == "env_timeout" and e.truncated and e.counts["env_timeouts"] == 1 and e.num_turns == 1


def test_an_environment_that_raises_makes_its_episode_unscorable() -> None:
    llm = make_llm()
    episodes, _ = runner(llm, env=lambda: ScriptedEnv(fail_at=2)).run(ROWS, [1, 2])
    batch = score_groups(episodes_to_batch(episodes, 1, runner(llm).chat, "zero", "ignore"), [], None)
    for e in episodes:
        assert e.finish == "env_error" and "the tool broke" in e.error and not e.truncated
    assert batch.rewards.isnan().all()


@pytest.mark.parametrize(
    ("limits", "finish"),
    [
        ({"max_turns": 2}, "max_turns"),
        ({"max_episode_tokens": 30}, "max_episode_tokens"),
        ({"max_tokens": 1}, "turn_length"),
    ],
)
def test_limits_truncate_and_the_truncated_reward_applies(limits: dict, finish: str) -> None:
    llm = make_llm()
    play = runner(llm, env=lambda: ScriptedEnv(turns=10), **limits)
    episodes, _ = play.run(ROWS * 2, [1, 2, 3, 4])
    assert any(e.finish == finish for e in episodes)
    for e in episodes:
        assert e.truncated
        assert e.num_turns <= limits.get("max_turns", 10)
        assert len(e.ids) <= limits.get("max_episode_tokens", 200)
        if e.finish == "turn_length":
            assert e.ids[-1] != EOS
    zero = score_groups(episodes_to_batch(episodes, 2, play.chat, "zero", "ignore"), [], None)
    unscorable = score_groups(episodes_to_batch(episodes, 2, play.chat, "unscorable", "ignore"), [], None)
    assert zero.rewards.tolist() == [0.0] * 4 and unscorable.rewards.isnan().all()
    assert episode_metrics(EpisodeLog(episodes))["env/truncated_frac"] == 1.0


def test_episode_rewards_and_per_turn_sums() -> None:
    llm = make_llm()
    play = runner(llm, env=lambda: ScriptedEnv(turns=3, turn_reward=0.25))
    episodes, _ = play.run(ROWS, [1, 2])
    assert all(e.finish == "done" for e in episodes)
    outcome = score_groups(episodes_to_batch(episodes, 1, play.chat, "zero", "ignore"), [], None)
    summed = score_groups(episodes_to_batch(episodes, 1, play.chat, "zero", "sum"), [], None)
    assert outcome.rewards.tolist() == [e.outcome for e in episodes]
    assert summed.rewards.tolist() == [e.outcome + 0.25 * 3 for e in episodes]


def test_a_truncated_episode_keeps_the_turn_rewards_it_earned() -> None:
    # Rewarded steps cut off by max_turns: `zero` zeroes the outcome only; each step's reward was earned when the
    # environment gave it (as a gym episode cut by its time limit keeps its rewards), so `sum` still adds them.
    # `unscorable` leaves the episode out, turn rewards or not.
    llm = make_llm()
    play = runner(llm, env=lambda: ScriptedEnv(turns=10, turn_reward=0.25), max_turns=2)
    episodes, _ = play.run(ROWS, [1, 2])
    assert all(e.truncated and e.turn_rewards == [0.25, 0.25] for e in episodes)
    summed = score_groups(episodes_to_batch(episodes, 1, play.chat, "zero", "sum"), [], None)
    assert summed.rewards.tolist() == [0.5, 0.5]
    unscorable = score_groups(episodes_to_batch(episodes, 1, play.chat, "unscorable", "sum"), [], None)
    assert unscorable.rewards.isnan().all()


def test_the_seed_alone_decides_an_episode() -> None:
    llm = make_llm()
    first, _ = runner(llm, workers=1).run(ROWS * 2, [1, 2, 3, 4])
    # other worker threads, environments finishing in another order: the same tokens
    again, _ = runner(llm, env=lambda: ScriptedEnv(sleep=0.01), workers=3).run(ROWS * 2, [1, 2, 3, 4])
    assert [e.ids for e in first] == [e.ids for e in again]
    other, _ = runner(llm).run(ROWS * 2, [11, 12, 13, 14])
    assert [e.ids for e in first] != [e.ids for e in other]
    assert not math.isnan(episode_metrics(EpisodeLog(first))["env/turns"])
