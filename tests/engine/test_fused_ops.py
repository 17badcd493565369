"""The decoder's fused elementwise ops (posttrain/kernels/decoder_ops.c) against PyTorch, and the
scope that limits them to the engine's forward."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from posttrain import kernels
from posttrain.engine import SamplingParams
from posttrain.kernels import fused
from posttrain.models.config import ModelConfig
from posttrain.models.layers import RotaryEmbedding, apply_rotary
from posttrain.models.transformer import Transformer
from tests.engine.tiny import make_llm, tiny_model

needs_kernels = pytest.mark.skipif(kernels.library() is None, reason="no C compiler with OpenMP here")


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@needs_kernels
@pytest.mark.parametrize("shape", [(512, 576), (3, 7), (2, 5, 9, 64), (1, 1)])
def test_rms_norm_matches_pytorch(shape: tuple[int, ...], kernel_march: str) -> None:
    torch.manual_seed(len(shape))
    x, weight = torch.randn(shape) * 4, torch.randn(shape[-1])
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-5), _torch_rms_norm(x, weight, 1e-5), rtol=2e-6, atol=2e-6)


@needs_kernels
def test_rms_norm_of_zeros_is_zeros_not_nan(kernel_march: str) -> None:
    assert torch.equal(fused.rms_norm(torch.zeros(4, 16), torch.ones(16), 1e-6), torch.zeros(4, 16))


@needs_kernels
@pytest.mark.parametrize("shape", [(512, 576), (3, 10)])
def test_add_rms_norm_returns_the_sum_and_its_norm(shape: tuple[int, ...], kernel_march: str) -> None:
    torch.manual_seed(1)
    x, delta, weight = torch.randn(shape), torch.randn(shape) * 3, torch.randn(shape[-1])
    total, normed = fused.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, x + delta)  # one float add each: exact
    torch.testing.assert_close(normed, _torch_rms_norm(x + delta, weight, 1e-6), rtol=2e-6, atol=2e-6)
    assert torch.equal(x, x.clone()) and not total.data_ptr() == x.data_ptr()  # the inputs are left alone


@needs_kernels
@pytest.mark.parametrize("lead, heads, d", [((512,), 9, 64), ((512,), 3, 64), ((2, 7), 4, 8), ((5,), 1, 2)])
def test_rotary_matches_apply_rotary(lead: tuple[int, ...], heads: int, d: int, kernel_march: str) -> None:
    torch.manual_seed(d)
    rope = RotaryEmbedding(d, 10000.0, None, 4096)
    cos, sin = rope(torch.randint(0, 4000, lead))  # (..., d)
    x = torch.randn(*lead, heads, d)
    expected = apply_rotary(x, cos, sin)  # outside the scope: PyTorch's ops
    torch.testing.assert_close(fused.rotary(x, cos, sin), expected, rtol=1e-6, atol=1e-6)


@needs_kernels
def test_rotary_refuses_cos_of_another_length() -> None:
    x, cos = torch.randn(4, 2, 8), torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"cos/sin \(3, 8\) do not match x \(4, 2, 8\)"):
        fused.rotary(x, cos, cos)


@needs_kernels
def test_silu_mul_matches_pytorch_including_large_gates(kernel_march: str) -> None:
    torch.manual_seed(2)
    gate, up = torch.randn(512, 1536) * 8, torch.randn(512, 1536)
    gate[0, :6] = torch.tensor([200.0, -200.0, 88.5, -88.5, 0.0, -0.0])  # past the exp's clamp, and zero
    expected = F.silu(gate) * up
    got = fused.silu_mul(gate, up)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-30)
    assert torch.isfinite(got).all()


@needs_kernels
def test_active_only_in_the_scope_without_autograd_on_fp32_cpu() -> None:
    x = torch.zeros(2, 8)
    with torch.no_grad():
        assert not fused.active(x)  # no scope: training and scoring keep PyTorch's ops
        with fused.fused_scope():
            assert fused.active(x)
            assert not fused.active(x.double())
            with fused.fused_scope():
                pass
            assert fused.active(x)  # the inner scope's exit leaves the outer one on
            seen = []
            worker = threading.Thread(target=lambda: seen.append(fused.active(x)))
            worker.start()
            worker.join()
            assert seen == [False]  # another thread (a trainer beside a server's engine) is not in it
        assert not fused.active(x)
    with fused.fused_scope():
        assert not fused.active(x)  # autograd on: the ops must stay differentiable


def test_scope_is_inert_with_the_kernels_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "library", lambda: None)
    monkeypatch.setattr(fused, "library", lambda: None)
    with torch.no_grad(), fused.fused_scope():
        assert not fused.active(torch.zeros(2, 8))


@needs_kernels
@pytest.mark.parametrize("qk_norm", [False, True])  # Llama; Qwen3's per-head q/k norms
def test_model_forward_in_the_scope_matches_pytorch(qk_norm: bool, kernel_march: str) -> None:
    cfg = ModelConfig(
        model_type="qwen3" if qk_norm else "llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=80,
        head_dim=16,
        max_position_embeddings=128,
        qk_norm=qk_norm,
    )
    torch.manual_seed(3)
    model = Transformer(cfg).eval()
    ids = torch.randint(0, 80, (2, 12))
    with torch.no_grad():
        expected = model(ids)
        with fused.fused_scope():
            got = model(ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_engine_takes_the_fused_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"rms_norm": 0, "add_rms_norm": 0, "rotary": 0, "silu_mul": 0}
    for name in calls:
        original = getattr(fused, name)

        def counted(*args, _name=name, _original=original):
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(fused, name, counted)
    llm = make_llm(tiny_model(), native_decode_step=False)  # the module path (the native step calls them in C)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    # 2 steps x 2 layers: the input norm (and the final norm), the add + norm, q and k, the MLP.
    assert calls == {"rms_norm": 2 * 3, "add_rms_norm": 2 * 2, "rotary": 2 * 4, "silu_mul": 2 * 2}
    with torch.no_grad():
        tiny_model()(torch.tensor([[1, 2, 3]]))  # a forward outside the engine takes none
    assert calls["rms_norm"] == 6


def test_engine_config_turns_every_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """EngineConfig.cpu_kernels=False: no fused op, no native attention, K/V write or draw, and the same tokens
    (greedy) as with the kernels on, within the engine's own reorder bound for sampled ones."""
    model = tiny_model()
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    with_kernels = make_llm(model).generate([[1, 2, 3], [4, 5]], params)

    def refuse(*args, **kwargs):
        raise AssertionError("a native kernel ran with cpu_kernels=False")

    for name in ("rms_norm", "add_rms_norm", "rotary", "silu_mul"):
        monkeypatch.setattr(fused, name, refuse)
    for name in ("write_kv", "decode_attention", "sample_rows"):
        monkeypatch.setattr(kernels, name, refuse)
    without = make_llm(model, cpu_kernels=False).generate([[1, 2, 3], [4, 5]], params)
    sampled = make_llm(model, cpu_kernels=False).generate([[1, 2, 3]], SamplingParams(max_tokens=4, seed=0))
    assert [o.outputs[0].token_ids for o in without] == [o.outputs[0].token_ids for o in with_kernels]
    assert len(sampled[0].outputs[0].token_ids) == 4
