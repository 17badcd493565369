"""Preference accuracy: the tie rule by hand, the reward-model trainer's held-out accuracy as an oracle,
the DPO implicit reward from hand-summed log-probabilities, hh-rlhf transcripts, and bad rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posttrain.data.config import DataConfig
from posttrain.data.formats import Preference
from posttrain.data.preference_pairs import load_pairs, tokenize_pair_for_policy
from posttrain.data.tokenize import IGNORE_INDEX
from posttrain.data.validate import DataError
from posttrain.errors import PosttrainError
from posttrain.eval import evaluate_dpo, evaluate_reward_model, pairwise_result
from posttrain.rewards import RewardModelScorer, save_score_head
from posttrain.rewards.model_reward import tokenize_pair_for_scoring
from posttrain.trainers.preference.logps import frozen_logps
from posttrain.trainers.reward_model import RewardModel, evaluate_rm
from tests.data.tiny import save_tiny_model_dir, tiny_model, tiny_tokenizer
from tests.trainers.pref_helpers import pair_rows, write_jsonl


def test_ties_count_half_by_hand():
    result = pairwise_result(torch.tensor([1.0, 2.0, 3.0, 0.5]), torch.tensor([0.0, 2.0, 4.0, 0.5]), 0.0, "rm")
    assert (result.wins, result.ties, result.losses, result.pairs) == (1, 2, 1, 4)
    assert result.accuracy == 0.5  # (1 + 2 / 2) / 4
    assert result.mean_margin == 0.0  # (1 + 0 - 1 + 0) / 4
    near = pairwise_result(torch.tensor([1.0, 1.0]), torch.tensor([0.99995, 0.9]), 1e-4, "dpo")
    assert (near.wins, near.ties, near.accuracy) == (1, 1, 0.75)
    with pytest.raises(PosttrainError, match="equal-length non-empty"):
        pairwise_result(torch.zeros(2), torch.zeros(3), 0.0, "rm")


def test_reward_model_matches_the_trainers_held_out_accuracy(tmp_path):
    directory = save_tiny_model_dir(tmp_path / "rm", seed=2)
    torch.manual_seed(0)
    save_score_head(torch.nn.Linear(32, 1, bias=True), directory)
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_rows())
    result = evaluate_reward_model(directory, data, batch_size=3)

    scorer = RewardModelScorer(directory)
    pairs = load_pairs(DataConfig(path=str(data)), scorer.tokenizer, 0, tokenize_pair_for_scoring).train
    oracle = evaluate_rm(RewardModel(scorer.model, scorer.score_head), pairs, batch_size=8, pad_token_id=0)
    assert result.pairs == oracle["eval_pairs"] == 8
    assert result.accuracy == pytest.approx(oracle["eval_accuracy"])
    assert result.mean_margin == pytest.approx(oracle["eval_margin"], abs=1e-5)
    chosen = scorer([r["prompt"] for r in pair_rows()], [r["chosen"] for r in pair_rows()])
    rejected = scorer([r["prompt"] for r in pair_rows()], [r["rejected"] for r in pair_rows()])
    assert result.margins == pytest.approx([c - r for c, r in zip(chosen, rejected)], abs=1e-5)
    assert result.data_report["format"] == "preference" and result.data_report["bad_rows"] == 0


def completion_logp(model, row) -> float:
    """Sum of log p(token | prefix) over the labelled (completion) tokens, from one full forward."""
    ids = torch.tensor([row.input_ids])
    logprobs = F.log_softmax(model(ids)[0].double(), dim=-1)  # (T, V)
    return sum(
        logprobs[t - 1, row.input_ids[t]].item() for t in range(1, len(row.input_ids)) if row.labels[t] != IGNORE_INDEX
    )


def test_dpo_implicit_reward_by_hand(tmp_path):
    policy, reference, tokenizer = tiny_model(seed=0), tiny_model(seed=1), tiny_tokenizer()
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_rows())
    result = evaluate_dpo(policy, reference, tokenizer, data, beta=0.5, batch_size=3)

    margins = []
    for row in pair_rows():
        pair = tokenize_pair_for_policy(
            tokenizer, Preference(row["prompt"], row["chosen"], row["rejected"]), DataConfig(path="x")
        )
        chosen = 0.5 * (completion_logp(policy, pair.chosen) - completion_logp(reference, pair.chosen))
        rejected = 0.5 * (completion_logp(policy, pair.rejected) - completion_logp(reference, pair.rejected))
        margins.append(chosen - rejected)
    assert result.margins == pytest.approx(margins, abs=1e-3)
    wins = sum(m > 1e-4 for m in margins)
    assert 0 < wins < 8  # a case with both outcomes, so the count means something
    assert result.accuracy == wins / 8 and result.wins == wins
    assert result.mean_margin == pytest.approx(sum(margins) / 8, abs=1e-3)
    assert result.beta == 0.5


def test_dpo_margins_equal_the_trainers_sequence_logps(tmp_path):
    """The engine's prompt logprobs against the DPO trainer's dense forward, on the same tokenized pairs."""
    policy, reference, tokenizer = tiny_model(seed=0), tiny_model(seed=1), tiny_tokenizer()
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_rows())
    result = evaluate_dpo(policy, reference, tokenizer, data, beta=0.5, batch_size=3)

    pairs = load_pairs(DataConfig(path=str(data)), tokenizer, 0, tokenize_pair_for_policy).train
    rows = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    rewards = 0.5 * (frozen_logps(policy, rows, 4, 0) - frozen_logps(reference, rows, 4, 0)).double()  # (2P,)
    expected = rewards[: len(pairs)] - rewards[len(pairs) :]
    assert result.margins == pytest.approx(expected.tolist(), abs=1e-4)


def test_dpo_scoring_shares_each_prompt_through_the_prefix_cache(tmp_path, monkeypatch):
    """The rejected rows of a wave take their pair's prompt blocks from the cache (the chosen rows computed
    them in the wave before), and the margins stay those of the trainer's dense forward."""
    import posttrain.eval.scoring as scoring

    engines = []

    class RecordingLLM(scoring.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(scoring, "LLM", RecordingLLM)
    policy, reference, tokenizer = tiny_model(seed=0), tiny_model(seed=1), tiny_tokenizer()
    rows = [
        {
            "prompt": "a long shared question about the weather in the mountains " * 2,
            "chosen": f" yes {i}",
            "rejected": f" no, not at all {i}",
        }
        for i in range(5)
    ]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    result = evaluate_dpo(policy, reference, tokenizer, data, beta=0.5, batch_size=2)
    assert len(engines) == 2  # the policy's scoring, then the reference's
    pairs = load_pairs(DataConfig(path=str(data)), tokenizer, 0, tokenize_pair_for_policy).train
    prompt_tokens = min(next(t for t, label in enumerate(p.chosen.labels) if label != IGNORE_INDEX) for p in pairs)
    prompt_blocks = (prompt_tokens - 1) // 16  # block_size 16 (eval/scoring.py)
    assert prompt_blocks >= 1
    for llm in engines:  # every rejected row: at least the prompt's full blocks but the one holding its end
        assert llm.stats()["prefix_cache_hit_tokens"] >= len(pairs) * prompt_blocks * 16
    sequence = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    rewards = 0.5 * (frozen_logps(policy, sequence, 4, 0) - frozen_logps(reference, sequence, 4, 0)).double()
    assert result.margins == pytest.approx((rewards[: len(pairs)] - rewards[len(pairs) :]).tolist(), abs=1e-4)


def test_policy_equal_to_reference_ties_everywhere_and_hh_rlhf_rows(tmp_path):
    transcripts = [
        {
            "chosen": "\n\nHuman: What is 2 plus 3?\n\nAssistant: Five.",
            "rejected": "\n\nHuman: What is 2 plus 3?\n\nAssistant: Blue.",
        },
        {
            "chosen": "\n\nHuman: Hello!\n\nAssistant: Hi, how can I help?\n\nHuman: Say 42.\n\nAssistant: 42.",
            "rejected": "\n\nHuman: Hello!\n\nAssistant: Hi, how can I help?\n\nHuman: Say 42.\n\nAssistant: No.",
        },
    ]
    data = write_jsonl(tmp_path / "hh.jsonl", transcripts)
    model = tiny_model(seed=3)
    result = evaluate_dpo(model, model, tiny_tokenizer(), data)
    assert result.data_report["format"] == "hh_rlhf" and result.pairs == 2
    assert (result.ties, result.accuracy, result.mean_margin) == (2, 0.5, 0.0)


def test_bad_rows_and_options_fail_with_the_file_and_line(tmp_path):
    rows = pair_rows()[:3]
    del rows[1]["rejected"]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    model, tokenizer = tiny_model(), tiny_tokenizer()
    with pytest.raises(DataError, match=r"pairs.jsonl:2: missing field 'rejected'"):
        evaluate_dpo(model, model, tokenizer, data)
    result = evaluate_dpo(model, model, tokenizer, data, max_bad_row_fraction=0.5)
    assert result.pairs == 2 and result.data_report["bad_rows"] == 1
    with pytest.raises(PosttrainError, match="beta must be > 0"):
        evaluate_dpo(model, model, tokenizer, data, beta=0.0)
    with pytest.raises(PosttrainError, match=r"preference data options: .*unexpected keyword argument 'colums'"):
        evaluate_dpo(model, model, tokenizer, data, colums={})
    with pytest.raises(PosttrainError, match="different vocabularies"):
        from tests.quant.tiny import tiny_model as other_vocab_model

        evaluate_dpo(model, other_vocab_model(), tokenizer, data)
    with pytest.raises(PosttrainError, match="no such file"):
        evaluate_dpo(model, model, tokenizer, tmp_path / "missing.jsonl")
    (tmp_path / "rm").mkdir()
    with pytest.raises(PosttrainError, match=r"rm: no config.json"):
        evaluate_reward_model(tmp_path / "rm", data)
