"""`posttrain estimate`: the formulas against hand-computed numbers on a tiny config, the activation and
loss-head count of every trainer against the tensors autograd really keeps, ZeRO sharding, the JSON output
and bad arguments."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.cli import main
from posttrain.data.preference_pairs import PairRow
from posttrain.data.tokenize import TokenizedRow
from posttrain.errors import PosttrainError
from posttrain.estimate import Architecture, TrainingSetup, estimate_memory, estimate_time
from posttrain.estimate.inputs import TRAINER_NAMES
from posttrain.estimate.memory import activations_bytes, kv_cache_bytes, layer_bytes_per_token, weights_bytes
from posttrain.estimate.trainer_rules import TRAINERS, loss_head, rules
from posttrain.models.config import ModelConfig
from posttrain.models.transformer import Transformer

# d=64, f=160, H=4, Hkv=2, D=16, V=100, 2 layers, tied: small enough to count by hand.
TINY = Architecture(
    layers=2, hidden=64, intermediate=160, heads=4, kv_heads=2, head_dim=16, vocab=100, tied_embeddings=True
)
# per layer: q 64*64 + k,v 2*64*32 + o 64*64 + mlp 3*64*160 + 2 norms of 64
LAYER_PARAMS = 4096 + 4096 + 4096 + 30720 + 128  # 43136
PARAMS = 2 * LAYER_PARAMS + 100 * 64 + 64  # + tied embedding + final norm = 92736
LINEAR_PARAMS = 2 * (LAYER_PARAMS - 128)  # 86016
ADAPTERS_R4 = 2 * 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 160) + (160 + 64))  # 11264


def tiny_model_config() -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        head_dim=16,
        tie_word_embeddings=True,
    )


def test_parameter_counts_match_the_model() -> None:
    assert TINY.num_parameters == PARAMS
    assert Architecture.from_model_config(tiny_model_config()).num_parameters == PARAMS
    assert Transformer(tiny_model_config()).num_parameters() == PARAMS
    assert TINY.linear_params == LINEAR_PARAMS


def test_weights_grads_optimizer_by_hand() -> None:
    fp32 = estimate_memory(TINY, TrainingSetup())
    assert fp32.weights_bytes == PARAMS * 4
    assert fp32.grads_bytes == PARAMS * 4
    assert fp32.optimizer_bytes == PARAMS * 8  # AdamW: two fp32 states

    bf16 = estimate_memory(TINY, TrainingSetup(dtype="bfloat16"))
    assert (bf16.weights_bytes, bf16.grads_bytes, bf16.optimizer_bytes) == (PARAMS * 2, PARAMS * 2, PARAMS * 4)
    mixed = estimate_memory(TINY, TrainingSetup(dtype="bf16", mixed=True))
    assert mixed.optimizer_bytes == PARAMS * 12  # fp32 m, v and master: the 2 + 2 + 12 bytes of the ZeRO paper
    sgd = estimate_memory(TINY, TrainingSetup(optimizer="sgd"))
    assert sgd.optimizer_bytes == PARAMS * 4


def test_lora_and_qlora_by_hand() -> None:
    lora = estimate_memory(TINY, TrainingSetup(method="lora", lora_r=4))
    assert lora.details["trainable_parameters"] == ADAPTERS_R4
    assert lora.weights_bytes == PARAMS * 4 + ADAPTERS_R4 * 4
    assert lora.grads_bytes == ADAPTERS_R4 * 4
    assert lora.optimizer_bytes == ADAPTERS_R4 * 8

    qlora = estimate_memory(TINY, TrainingSetup(method="qlora", lora_r=4, dtype="bfloat16"))
    quantized = LINEAR_PARAMS // 2 + (LINEAR_PARAMS // 64) * 2  # 4 bits a weight + an fp16 scale per 64
    assert qlora.weights_bytes == quantized + (PARAMS - LINEAR_PARAMS) * 2 + ADAPTERS_R4 * 4  # adapters fp32
    assert qlora.grads_bytes == ADAPTERS_R4 * 4


def test_zero_stages_divide_optimizer_then_grads_then_weights() -> None:
    base = TrainingSetup(gpus=4)
    one = estimate_memory(TINY, base)
    sharded = [estimate_memory(TINY, TrainingSetup(gpus=4, zero=stage)) for stage in (1, 2, 3)]
    assert sharded[0].optimizer_bytes == one.optimizer_bytes // 4
    assert sharded[0].grads_bytes == one.grads_bytes and sharded[0].weights_bytes == one.weights_bytes
    assert sharded[1].grads_bytes == one.grads_bytes // 4 and sharded[1].weights_bytes == one.weights_bytes
    assert sharded[2].weights_bytes == one.weights_bytes // 4
    assert one.total_bytes > sharded[0].total_bytes > sharded[2].total_bytes
    assert estimate_memory(TINY, TrainingSetup(gpus=1, zero=3)).weights_bytes == one.weights_bytes


def test_layer_activations_by_hand() -> None:
    # fp32, full: each norm 12d + 4; attention 4 * (2 * 64 + 2 * 32) + 4 * 4 (lse); SwiGLU 4 * 4 * 160
    assert layer_bytes_per_token(TINY, TrainingSetup()) == 2 * (12 * 64 + 4) + 768 + 16 + 2560
    # bf16: norms keep an fp32 input and rsqrt + two bf16 vectors; RoPE's bf16 cos/sin copies (4 x D x 2)
    assert (
        layer_bytes_per_token(TINY, TrainingSetup(dtype="bfloat16"))
        == 2 * (4 * 64 + 4 + 4 * 64) + 4 * 16 * 2 + 2 * 192 + 16 + 2 * 4 * 160
    )


def test_kv_cache_formula() -> None:
    setup = TrainingSetup(trainer="grpo", batch=16, seq_len=100, prompt_len=20, group_size=8)
    # 2 x layers x kv_heads x head_dim x bytes x tokens; 16 sequences of 100 tokens in whole 16-token blocks
    assert kv_cache_bytes(TINY, setup) == 2 * 2 * 2 * 16 * 4 * (16 * 112)
    assert kv_cache_bytes(TINY, TrainingSetup(trainer="grpo", seq_len=100, kv_tokens=1000)) == 2 * 2 * 2 * 16 * 4 * 1000
    assert kv_cache_bytes(TINY, TrainingSetup()) == 0  # SFT has no rollout


def _saved_bytes(model: torch.nn.Module, forward: object) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps for backward during `forward()`."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() > 0:  # 0-dim tensors are LoRA's wrapped scaling constants: bytes, not per-token memory
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


@pytest.mark.parametrize("method", ["full", "lora"])
def test_activation_count_matches_what_autograd_keeps(method: str) -> None:
    torch.manual_seed(0)
    model = Transformer(tiny_model_config())
    if method == "lora":
        from posttrain.peft import LoraConfig, apply_lora

        apply_lora(model, LoraConfig(r=4))
    ids = torch.randint(0, 100, (3, 24))
    measured = _saved_bytes(model, lambda: model.hidden_states(ids))
    setup = TrainingSetup(method=method, lora_r=4, batch=3, seq_len=24)
    assert activations_bytes(TINY, setup) == measured


def test_grpo_activations_count_the_packed_rows_and_their_mask() -> None:
    from posttrain.trainers.packed_groups import pack_groups

    torch.manual_seed(0)
    model = Transformer(tiny_model_config())
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    completions = [[[11, 12, 13, 14]] * 4, [[15, 16, 17, 18]] * 4]  # 2 groups of 4, completion length 4
    pack = pack_groups(prompts, completions)
    from posttrain.models.attention import DenseAttentionMetadata

    measured = _saved_bytes(
        model,
        lambda: model.hidden_states(
            pack.input_ids, positions=pack.positions, attn_meta=DenseAttentionMetadata(pack.mask)
        ),
    )
    setup = TrainingSetup(trainer="grpo", batch=8, group_size=4, seq_len=9, prompt_len=5)
    # rows of 5 + 4 x 3 = 17 tokens; the positions are (R, T) here, so RoPE's cos/sin are per token too
    assert activations_bytes(TINY, setup) == measured


def test_grpo_rows_are_cut_as_the_update_cuts_them() -> None:
    from posttrain.estimate.trainer_rules import trunk_tokens
    from posttrain.trainers.packed_groups import ROW_TOKENS, pack_groups

    prompt, inputs = 100, 300  # 8 completions of 301 tokens: 2 a row within ROW_TOKENS (768)
    setup = TrainingSetup(trainer="grpo", batch=16, group_size=8, seq_len=prompt + inputs + 1, prompt_len=prompt)
    pack = pack_groups([[1] * prompt] * 2, [[[2] * (inputs + 1)] * 8] * 2, row_tokens=ROW_TOKENS)
    assert trunk_tokens(setup) == tuple(pack.input_ids.shape) == (8, prompt + 2 * inputs)


# ----------------------------------------------------------------------------- every trainer's forward


def _tiny(method: str, dtype: torch.dtype) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(tiny_model_config()).to(dtype)
    if method == "lora":
        from posttrain.peft import LoraConfig, apply_lora

        apply_lora(model, LoraConfig(r=4))
    return model


def _row(prompt: int, completion: int, first: int = 1) -> TokenizedRow:
    """A tokenized row of `prompt` tokens without a target and `completion` tokens with one."""
    ids = list(range(first, first + prompt + completion))
    return TokenizedRow(ids, [-100] * prompt + ids[prompt:])


def _pairs(prompt: int, completion: int) -> list[PairRow]:
    """Two preference pairs whose four rows have the same length, so every row has `completion` targets."""
    return [
        PairRow(_row(prompt, completion, 1), _row(prompt, completion, 30)),
        PairRow(_row(prompt, completion, 50), _row(prompt, completion, 70)),
    ]


def _measure_sft(model: Transformer) -> tuple[int, TrainingSetup]:
    from posttrain.data.collate import collate
    from posttrain.trainers.sft import sft_loss_sum

    batch = collate([_row(5, 7, 1), _row(5, 7, 40), _row(5, 7, 80)], 0)
    return _saved_bytes(model, lambda: sft_loss_sum(model, batch)), TrainingSetup(batch=3, seq_len=12, prompt_len=5)


def _measure_dpo(model: Transformer) -> tuple[int, TrainingSetup]:
    """pair_logps over two packed pairs (each pair's rows share their prompt) and the sigmoid loss, with
    precomputed (here: zero) reference log-probs."""
    from posttrain.trainers.preference.dpo import DPOConfig, preference_loss
    from posttrain.trainers.preference.logps import collate_pairs, pair_logps

    shared = [PairRow(_row(5, 7, first), _row(5, 7, first)) for first in (1, 50)]
    pairs = [PairRow(p.chosen, TokenizedRow(p.chosen.input_ids[:5] + [90] * 7, [-100] * 5 + [90] * 7)) for p in shared]
    batch = collate_pairs(pairs, 0)

    def forward() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logps, lengths = pair_logps(model, batch)  # (4,), (4,)
        return preference_loss(DPOConfig(), logps, lengths, (torch.zeros(2), torch.zeros(2), None), None)

    # logsigmoid keeps its (B,) fp32 input and buffer: per pair, not per token, and not counted
    return _saved_bytes(model, forward) - 2 * 4 * 2, TrainingSetup(trainer="dpo", batch=2, seq_len=12, prompt_len=5)


def _measure_rm(model: Transformer) -> tuple[int, TrainingSetup]:
    from posttrain.algos.reward import bradley_terry_loss
    from posttrain.trainers.reward_model import RewardModel, new_score_head, pair_scores

    rm = RewardModel(model, new_score_head(64, "cpu"))
    measured = _saved_bytes(rm, lambda: bradley_terry_loss(*pair_scores(rm, _pairs(5, 7), 0)))
    # as for DPO: the loss's logsigmoid keeps two fp32 (B,) vectors, not counted
    return measured - 2 * 4 * 2, TrainingSetup(trainer="rm", batch=2, seq_len=12)


def _measure_rm_packed(model: Transformer) -> tuple[int, TrainingSetup]:
    """pair_scores over two pairs whose sequences share their first 5 tokens: one packed row each."""
    from posttrain.algos.reward import bradley_terry_loss
    from posttrain.trainers.reward_model import RewardModel, new_score_head, pack_sequences, pair_scores

    rm = RewardModel(model, new_score_head(64, "cpu"))
    pairs = [PairRow(_row(5, 7, first), _row(5, 7, first)) for first in (1, 50)]
    pairs = [PairRow(p.chosen, TokenizedRow(p.chosen.input_ids[:5] + [90] * 7, [-100] * 12)) for p in pairs]
    assert pack_sequences(pairs, "cpu") is not None
    measured = _saved_bytes(rm, lambda: bradley_terry_loss(*pair_scores(rm, pairs, 0)))
    return measured - 2 * 4 * 2, TrainingSetup(trainer="rm", batch=2, seq_len=12, prompt_len=5)


def _measure_rl(model: Transformer, trainer: str) -> tuple[int, TrainingSetup]:
    """packed_forward as the update calls it (entropy as a metric; PPO with its value head). The policy and
    value losses on the (B, L) outputs are not counted (docs/estimate.md says what they keep)."""
    from posttrain.trainers.packed_groups import pack_groups, packed_forward
    from posttrain.trainers.rl.ppo import ValueHead

    pack = pack_groups([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], [[[11, 12, 13, 14]] * 4, [[15, 16, 17, 18]] * 4])
    head = ValueHead(64, model.dtype, model.device) if trainer == "ppo" else None
    both = torch.nn.ModuleList([model] + ([head] if head is not None else []))  # the head's weights are no activations
    measured = _saved_bytes(both, lambda: packed_forward(model, pack, 1.0, with_entropy=True, value_head=head))
    return measured, TrainingSetup(trainer=trainer, batch=8, group_size=4, seq_len=9, prompt_len=5)


@pytest.mark.parametrize(
    "method, dtype", [("full", "float32"), ("lora", "float32"), ("full", "bfloat16"), ("lora", "bfloat16")]
)
@pytest.mark.parametrize("trainer", ["sft", "dpo", "rm", "rm_packed", "grpo", "ppo"])
def test_trainer_forward_keeps_activations_plus_loss_head(trainer: str, method: str, dtype: str) -> None:
    """Each trainer's own loss forward on a tiny model: the estimator's activations plus the loss head's kept
    tensors are exactly the bytes autograd saves (the loss's per-pair scalars aside, see _measure_dpo)."""
    model = _tiny(method, getattr(torch, dtype))
    if trainer in ("grpo", "ppo"):
        measured, shape = _measure_rl(model, trainer)
    else:
        measures = {"sft": _measure_sft, "dpo": _measure_dpo, "rm": _measure_rm, "rm_packed": _measure_rm_packed}
        measured, shape = measures[trainer](model)
    setup = TrainingSetup(**{**vars(shape), "method": method, "lora_r": 4, "dtype": dtype})
    assert activations_bytes(TINY, setup) + loss_head(TINY, setup).saved == measured


def test_score_and_value_heads_by_hand() -> None:
    # RM: the score head Linear(64, 1, bias=False) is fp32 whatever the model dtype
    rm = estimate_memory(TINY, TrainingSetup(trainer="rm", dtype="bfloat16"))
    assert rm.details["head_parameters"] == 64
    assert (rm.weights_bytes, rm.grads_bytes) == (PARAMS * 2 + 64 * 4, PARAMS * 2 + 64 * 4)
    assert rm.optimizer_bytes == PARAMS * 4 + 64 * 8
    # an untied LM head is never run by the reward model: no gradient, no AdamW state, but still loaded
    untied = Architecture(**{**vars(TINY), "tied_embeddings": False})
    rm_untied = estimate_memory(untied, TrainingSetup(trainer="rm"))
    assert rm_untied.details["trainable_parameters"] == untied.num_parameters - 100 * 64 + 64
    assert rm_untied.weights_bytes == (untied.num_parameters + 64) * 4
    # PPO: the value head Linear(64, 1) with bias, in the model dtype, trains in full beside LoRA adapters
    ppo = estimate_memory(TINY, TrainingSetup(trainer="ppo", method="lora", lora_r=4, dtype="bfloat16"))
    assert ppo.details["trainable_parameters"] == ADAPTERS_R4 + 65
    assert ppo.weights_bytes == PARAMS * 2 + ADAPTERS_R4 * 2 + 65 * 2
    mixed = estimate_memory(TINY, TrainingSetup(trainer="ppo", dtype="bfloat16", mixed=True))
    assert mixed.optimizer_bytes == (PARAMS + 65) * 12


def test_reference_copy_is_whole_on_every_device() -> None:
    # DPO's and RL's references are deep copies taken before DDP / FSDP2 wrap the policy: ZeRO-3 shards
    # the policy's weights, not the copy
    sharded = estimate_memory(TINY, TrainingSetup(trainer="dpo", reference=True, zero=3, gpus=4))
    assert sharded.reference_bytes == PARAMS * 4 and sharded.weights_bytes == PARAMS * 4 // 4
    lora = estimate_memory(TINY, TrainingSetup(trainer="dpo", reference=True, method="lora", lora_r=4))
    assert lora.reference_bytes == 0  # the base with its adapters off


def test_dpo_live_reference_pass_holds_its_hidden_states_and_logits() -> None:
    # the reference scores the B packed pairs after the policy's forward: its (B, T, d) hidden states and its
    # (N, V) fp32 logits, against the (N, V) gradient at the start of backward without it. T = 5 + 2 x 6.
    for method in ("full", "lora"):
        base = TrainingSetup(trainer="dpo", method=method, lora_r=4, batch=2, seq_len=12, prompt_len=5)
        live = TrainingSetup(**{**vars(base), "reference": True})
        assert loss_head(TINY, live).peak - loss_head(TINY, base).peak == 2 * 17 * 64 * 4


def test_time_of_each_trainer() -> None:
    from posttrain.estimate.compute import forward_flops, train_flops

    # RM: 2B = 4 rows of 10 tokens, causal; no LM head, the score head on each row's last state
    rm = TrainingSetup(trainer="rm", batch=2, seq_len=10)
    forward = 2 * LINEAR_PARAMS * 40 + 4 * 2 * 4 * 16 * (4 * 10 * 11 // 2) + 2 * 64 * 4
    assert forward_flops(TINY, rm) == forward and train_flops(TINY, rm) == 3 * forward
    # DPO: B = 2 packed rows of the prompt (4) and both completions without their last token (2 x 5): 28 tokens;
    # each completion token sees the prompt and its own earlier ones; the LM head on 2B x 6 targets. A live
    # reference adds one no-grad forward.
    dpo = TrainingSetup(trainer="dpo", batch=2, seq_len=10, prompt_len=4)
    attended = 2 * (4 * 5 // 2 + 2 * (5 * 4 + 5 * 6 // 2))
    dpo_forward = 2 * LINEAR_PARAMS * 28 + 4 * 2 * 4 * 16 * attended + 2 * 100 * 64 * 4 * 6
    assert forward_flops(TINY, dpo) == dpo_forward
    live = TrainingSetup(**{**vars(dpo), "reference": True})
    assert train_flops(TINY, live) == 4 * forward_flops(TINY, dpo)
    # PPO: GRPO's forward + the value head on every target, and its old-logprob / value pass
    grpo = TrainingSetup(trainer="grpo", batch=8, group_size=4, seq_len=9, prompt_len=5)
    ppo = TrainingSetup(**{**vars(grpo), "trainer": "ppo"})
    assert forward_flops(TINY, ppo) == forward_flops(TINY, grpo) + 2 * 64 * 32
    assert train_flops(TINY, ppo) == 4 * forward_flops(TINY, ppo)
    ppo_kl = TrainingSetup(**{**vars(ppo), "reference": True})  # the reference has no value head
    assert train_flops(TINY, ppo_kl) == train_flops(TINY, ppo) + forward_flops(TINY, grpo)


def test_peak_rule_max_without_accumulation_sum_with() -> None:
    one = estimate_memory(TINY, TrainingSetup(batch=4, seq_len=64))
    two = estimate_memory(TINY, TrainingSetup(batch=4, seq_len=64, grad_accum=2))
    static = one.weights_bytes + one.optimizer_bytes
    assert one.total_bytes == static + max(one.grads_bytes, one.activations_bytes + one.logits_bytes)
    assert two.total_bytes == static + one.grads_bytes + one.activations_bytes + one.logits_bytes
    assert one.total_checkpointed_bytes <= one.total_bytes
    assert one.activations_checkpointed_bytes < one.activations_bytes


def test_time_is_flops_over_throughput() -> None:
    setup = TrainingSetup(batch=2, seq_len=10)
    t = estimate_time(TINY, setup, weights_bytes(TINY, setup), tflops=1.0, bandwidth_gbs=100.0)
    tokens = 20
    forward = 2 * LINEAR_PARAMS * tokens + 2 * 100 * 64 * tokens + 4 * 2 * 4 * 16 * (2 * 10 * 11 // 2)
    assert t.train_flops == 3 * forward
    assert t.step_seconds == pytest.approx(3 * forward / 1e12)


def test_from_params_solves_the_intermediate_size() -> None:
    arch = Architecture.from_params(7_000_000_000, layers=32, hidden=4096, kv_heads=8, vocab=128256)
    assert arch.num_parameters == 7_000_000_000
    assert abs(arch.shape_params - 7e9) / 7e9 < 0.01
    with pytest.raises(PosttrainError, match="too small"):
        Architecture.from_params(1000, layers=32, hidden=4096)


def test_cli_json_keys_and_default_model(capsys: pytest.CaptureFixture[str], default_model_dir: object) -> None:
    assert main(["estimate", "--json", "--batch", "2", "--seq-len", "128"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "weights_bytes",
        "grads_bytes",
        "optimizer_bytes",
        "activations_bytes",
        "kv_cache_bytes",
        "total_bytes",
        "activations_checkpointed_bytes",
        "step_seconds",
    ):
        assert isinstance(out[key], (int, float)), key
    assert out["parameters"] == 134_515_008  # SmolLM2-135M, read from its config only
    assert out["model"] == "smollm2-135m" and out["dtype"] == "float32"


def test_cli_params_and_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "estimate",
                "--params",
                "1.5B",
                "--layers",
                "28",
                "--hidden",
                "1536",
                "--heads",
                "12",
                "--kv-heads",
                "2",
                "--vocab",
                "151936",
                "--device",
                "h100",
                "--trainer",
                "grpo",
                "--batch",
                "64",
                "--seq-len",
                "1024",
                "--prompt-len",
                "256",
                "--method",
                "lora",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "rollout KV cache" in text and "fits in one h100" in text


def _cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["estimate", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_dpo_rm_ppo(capsys: pytest.CaptureFixture[str], default_model_dir: object) -> None:
    shape = ("--batch", "2", "--seq-len", "128", "--prompt-len", "32")
    dpo = _cli_json(capsys, "--trainer", "dpo", *shape)
    for key in ("weights_bytes", "logits_bytes", "reference_bytes", "kv_cache_bytes", "head_parameters", "total_bytes"):
        assert isinstance(dpo[key], int), key
    assert dpo["trunk_tokens"] == 2 * (32 + 2 * 95) and dpo["logit_tokens"] == 4 * 96  # 2 pairs: 2 packed rows
    assert dpo["reference_bytes"] == dpo["kv_cache_bytes"] == 0  # reference=precompute; no rollout
    live = _cli_json(capsys, "--trainer", "dpo", "--reference", *shape)
    assert live["reference_bytes"] == live["weights_bytes"]  # full fine-tuning: one more copy of the weights
    assert live["total_bytes"] > dpo["total_bytes"]
    assert _cli_json(capsys, "--trainer", "dpo", "--reference", "--method", "lora", *shape)["reference_bytes"] == 0

    rm = _cli_json(capsys, "--trainer", "rm", *shape)
    d = 576  # SmolLM2-135M's hidden size
    assert rm["logit_tokens"] == 0 and rm["head_parameters"] == d
    assert rm["logits_bytes"] == 4 * (8 + d * 4)  # the score head's rows and their index, no logits
    assert rm["trunk_tokens"] == 2 * (32 + 2 * 96)  # 2 pairs: 2 packed rows, each sequence whole after the prompt
    unpacked = _cli_json(capsys, "--trainer", "rm", "--batch", "2", "--seq-len", "128")  # no prompt: 4 rows
    assert unpacked["trunk_tokens"] == 4 * 128 and unpacked["logits_bytes"] == 4 * (2 * 8 + d * 4)

    rl = ("--batch", "8", "--group-size", "4", "--seq-len", "128", "--prompt-len", "32")
    grpo, ppo = (_cli_json(capsys, "--trainer", t, *rl) for t in ("grpo", "ppo"))
    assert ppo["kv_cache_bytes"] == grpo["kv_cache_bytes"] > 0
    assert ppo["weights_bytes"] - grpo["weights_bytes"] == (d + 1) * 4  # the value head, fp32 on cpu
    assert ppo["activations_bytes"] == grpo["activations_bytes"] and ppo["train_flops"] > grpo["train_flops"]


def test_cli_unknown_trainer_names_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--trainer", "kto-ish"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'kto-ish'" in err and "'sft', 'dpo', 'rm', 'grpo', 'ppo'" in err
    with pytest.raises(PosttrainError, match="trainer 'kto-ish' is not one of sft, dpo, rm, grpo, ppo"):
        TrainingSetup(trainer="kto-ish")  # type: ignore[arg-type]


def test_every_trainer_a_setup_accepts_has_rules() -> None:
    # inputs.py validates against the `Trainer` names without importing trainer_rules (that import made a
    # circle); the two lists must stay the same, in the order the messages list them.
    assert tuple(TRAINERS) == TRAINER_NAMES
    for name in TRAINER_NAMES:
        assert rules(TrainingSetup(trainer=name)) is TRAINERS[name]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--params", "7B"], "--params needs --layers and --hidden"),
        (["--layers", "4"], "use them with --params"),
        (["--model", "x", "--params", "7B", "--layers", "2", "--hidden", "64"], "not both"),
        (
            ["--prompt-len", "600", "--seq-len", "512", "--params", "10M", "--layers", "2", "--hidden", "64"],
            "prompt-len",
        ),
        (["--batch", "0", "--params", "10M", "--layers", "2", "--hidden", "64"], "batch must be at least 1"),
        (
            ["--lora-targets", "q_proj,nope", "--method", "lora", "--params", "10M", "--layers", "2", "--hidden", "64"],
            "lora targets",
        ),
        (["--model", "/no/such/model"], "no such file"),
        (
            ["--trainer", "rm", "--reference", "--params", "10M", "--layers", "2", "--hidden", "64"],
            "the rm trainer has no reference model",
        ),
    ],
)
def test_cli_bad_arguments_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_malformed_counts() -> None:
    with pytest.raises(SystemExit):
        main(["estimate", "--params", "seven"])
