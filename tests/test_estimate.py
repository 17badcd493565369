"""`posttrain estimate`: the formulas against hand-computed numbers on a tiny config, the activation
count against the tensors autograd really keeps, ZeRO sharding, the JSON output and bad arguments."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.cli import main
from posttrain.errors import PosttrainError
from posttrain.estimate import Architecture, TrainingSetup, estimate_memory, estimate_time
from posttrain.estimate.memory import activations_bytes, kv_cache_bytes, layer_bytes_per_token, weights_bytes
from posttrain.models.config import ModelConfig
from posttrain.models.transformer import Transformer

# d=64, f=160, H=4, Hkv=2, D=16, V=100, 2 layers, tied: small enough to count by hand.
TINY = Architecture(layers=2, hidden=64, intermediate=160, heads=4, kv_heads=2, head_dim=16, vocab=100,
                    tied_embeddings=True)
# per layer: q 64*64 + k,v 2*64*32 + o 64*64 + mlp 3*64*160 + 2 norms of 64
LAYER_PARAMS = 4096 + 4096 + 4096 + 30720 + 128  # 43136
PARAMS = 2 * LAYER_PARAMS + 100 * 64 + 64  # + tied embedding + final norm = 92736
LINEAR_PARAMS = 2 * (LAYER_PARAMS - 128)  # 86016
ADAPTERS_R4 = 2 * 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 160) + (160 + 64))  # 11264


def tiny_model_config() -> ModelConfig:
    return ModelConfig(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=100, head_dim=16,
                       tie_word_embeddings=True)


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
    assert layer_bytes_per_token(TINY, TrainingSetup(dtype="bfloat16")) == \
        2 * (4 * 64 + 4 + 4 * 64) + 4 * 16 * 2 + 2 * 192 + 16 + 2 * 4 * 160


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
    from posttrain.trainers.rl_batch import pack_groups

    torch.manual_seed(0)
    model = Transformer(tiny_model_config())
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    completions = [[[11, 12, 13, 14]] * 4, [[15, 16, 17, 18]] * 4]  # 2 groups of 4, completion length 4
    pack = pack_groups(prompts, completions)
    from posttrain.models.attention import DenseAttentionMetadata

    measured = _saved_bytes(model, lambda: model.hidden_states(
        pack.input_ids, positions=pack.positions, attn_meta=DenseAttentionMetadata(pack.mask)))
    setup = TrainingSetup(trainer="grpo", batch=8, group_size=4, seq_len=9, prompt_len=5)
    # rows of 5 + 4 x 3 = 17 tokens; the positions are (R, T) here, so RoPE's cos/sin are per token too
    assert activations_bytes(TINY, setup) == measured


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
    for key in ("weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "kv_cache_bytes",
                "total_bytes", "activations_checkpointed_bytes", "step_seconds"):
        assert isinstance(out[key], (int, float)), key
    assert out["parameters"] == 134_515_008  # SmolLM2-135M, read from its config only
    assert out["model"] == "smollm2-135m" and out["dtype"] == "float32"


def test_cli_params_and_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "1.5B", "--layers", "28", "--hidden", "1536", "--heads", "12",
                 "--kv-heads", "2", "--vocab", "151936", "--device", "h100", "--trainer", "grpo", "--batch", "64",
                 "--seq-len", "1024", "--prompt-len", "256", "--method", "lora"]) == 0
    text = capsys.readouterr().out
    assert "rollout KV cache" in text and "fits in one h100" in text


@pytest.mark.parametrize("argv, message", [
    (["--params", "7B"], "--params needs --layers and --hidden"),
    (["--layers", "4"], "use them with --params"),
    (["--model", "x", "--params", "7B", "--layers", "2", "--hidden", "64"], "not both"),
    (["--prompt-len", "600", "--seq-len", "512", "--params", "10M", "--layers", "2", "--hidden", "64"], "prompt-len"),
    (["--batch", "0", "--params", "10M", "--layers", "2", "--hidden", "64"], "batch must be at least 1"),
    (["--lora-targets", "q_proj,nope", "--method", "lora", "--params", "10M", "--layers", "2", "--hidden", "64"],
     "lora targets"),
    (["--model", "/no/such/model"], "no such file"),
])
def test_cli_bad_arguments_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_malformed_counts() -> None:
    with pytest.raises(SystemExit):
        main(["estimate", "--params", "seven"])
