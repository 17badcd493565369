"""GPTQ: against round-to-nearest (the exact special case when inputs are uncorrelated), the output error it
minimises, a whole tiny model, and the calibration windows."""

from __future__ import annotations

import pytest
import torch

from posttrain.errors import PosttrainError
from posttrain.quant import (
    QuantizedLinear,
    calibration_batch,
    dequantize_weight,
    get_scheme,
    gptq_quantize,
    gptq_quantize_model,
    load_quantized_dir,
    quantize_model,
    quantize_weight,
    save_quantized,
)
from tests.quant.tiny import char_tokenizer, tiny_model

SCHEMES = ["int4-g32", "int4-g32-asym", "int4-g128", "int8", "int8-asym"]


def correlated_inputs(M: int, K: int, seed: int = 0) -> torch.Tensor:
    """(M, K) inputs with correlated features and uneven scales, like a layer's activations."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(K, K, generator=g) / K**0.5 + torch.eye(K)
    return (torch.randn(M, K, generator=g) @ mix) * torch.linspace(0.2, 3.0, K)


def output_error(X: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    return float((X @ (w - wq).T).square().sum())


@pytest.mark.parametrize("scheme_name", SCHEMES)
@pytest.mark.parametrize("act_order", [False, True])
def test_uncorrelated_inputs_give_round_to_nearest(scheme_name, act_order):
    # H diagonal: no column's error can be corrected by another, so GPTQ must round exactly as RTN does
    # (also after act_order's permutation by the distinct diagonal values is undone).
    scheme = get_scheme(scheme_name)
    w = torch.randn(48, 160, generator=torch.Generator().manual_seed(1))
    H = torch.diag(torch.linspace(0.5, 2.0, 160))
    result = gptq_quantize(w, H, scheme, act_order=act_order)
    codes, scales, zeros = quantize_weight(w, scheme)
    assert torch.equal(result.codes, codes) and torch.equal(result.scales, scales)
    assert (zeros is None and result.zeros is None) or torch.equal(result.zeros, zeros)


@pytest.mark.parametrize("scheme_name", SCHEMES)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_the_output_error_on_correlated_inputs(scheme_name, act_order):
    scheme = get_scheme(scheme_name)
    K = 192
    X = correlated_inputs(2048, K)
    w = torch.randn(64, K, generator=torch.Generator().manual_seed(2)) * 0.05
    H = X.T @ X / X.shape[0]
    result = gptq_quantize(w, H, scheme, act_order=act_order)
    assert result.codes.dtype == torch.int8
    assert int(result.codes.min()) >= scheme.q_min and int(result.codes.max()) <= scheme.q_max
    gptq_w = dequantize_weight(result.codes, result.scales, result.zeros, scheme.group_size)
    rtn_w = dequantize_weight(*quantize_weight(w, scheme), scheme.group_size)
    assert output_error(X, w, gptq_w) < 0.8 * output_error(X, w, rtn_w)
    # the reported proxy loss is the error it left under the damped H: sum over rows of dW H_damped dW^T / 2
    delta = (w - gptq_w).double()
    damped = H.double() + 0.01 * H.diagonal().mean().double() * torch.eye(K, dtype=torch.float64)
    assert result.proxy_loss == pytest.approx(float(((delta @ damped) * delta).sum()) / 2, rel=1e-3)


@pytest.mark.parametrize("scheme_name", ["int4-g32", "int4-g32-asym", "int8"])
def test_clip_search_never_rounds_worse(scheme_name):
    from posttrain.quant.codec import codes_to_values, group_params, grouped_view, round_to_codes, search_clip

    scheme = get_scheme(scheme_name)
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(3))
    w[0, 5] = 12.0  # an outlier: clipping it gives the rest of its group a finer grid
    wg = grouped_view(w, scheme.effective_group_size(128))
    importance = torch.rand(wg.shape[-2:], generator=torch.Generator().manual_seed(4))

    def error(scales, zeros):
        residual = codes_to_values(round_to_codes(wg, scales, zeros, scheme), scales, zeros) - wg
        return (residual.square() * importance).sum(-1)

    searched, plain = error(*search_clip(wg, scheme, importance)), error(*group_params(wg, scheme))
    assert torch.all(searched <= plain)
    if scheme.bits == 4:  # at 16 levels the outlier's group gains from the clip
        assert float(searched[0].sum()) < float(plain[0].sum())


def test_dead_inputs_and_bad_arguments():
    scheme = get_scheme("int4-g32")
    X = correlated_inputs(512, 64)
    X[:, 5] = 0  # an input that is always zero: its weights cannot matter and are set to 0
    w = torch.randn(16, 64)
    result = gptq_quantize(w, X.T @ X / 512, scheme)
    assert torch.all(dequantize_weight(result.codes, result.scales, None, 32)[:, 5] == 0)
    with pytest.raises(PosttrainError, match="Hessian is \\(63, 63\\), expected \\(64, 64\\)"):
        gptq_quantize(w, torch.eye(63), scheme, source="layers.0.mlp.up_proj")
    with pytest.raises(PosttrainError, match="damp must be > 0"):
        gptq_quantize(w, torch.eye(64), scheme, damp=0)
    with pytest.raises(PosttrainError, match="2-D float weight"):
        gptq_quantize(torch.ones(4, 4, dtype=torch.long), torch.eye(4), scheme)


def test_calibration_windows():
    rows = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    ids = calibration_batch(rows, num_samples=3, seq_len=4, separator=0)
    assert ids.tolist() == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]]
    assert calibration_batch(rows, num_samples=10, seq_len=5).tolist() == [[1, 2, 3, 4, 5]]  # what there is
    with pytest.raises(PosttrainError, match="fewer than one window of 100"):
        calibration_batch(rows, num_samples=2, seq_len=100)


def test_whole_model_beats_round_to_nearest_and_round_trips(tmp_path):
    torch.manual_seed(0)
    calibration = torch.randint(3, 128, (16, 48))
    held_out = torch.randint(3, 128, (8, 48))
    reference = tiny_model()
    with torch.no_grad():
        expected = reference(held_out)
    rtn = quantize_model(tiny_model(), "int4-g32")
    gptq = tiny_model()
    losses = gptq_quantize_model(gptq, "int4-g32", calibration, batch_size=5)
    assert sorted(losses) == sorted(n for n, m in gptq.named_modules() if isinstance(m, QuantizedLinear))
    assert len(losses) == 2 * 7 and all(v >= 0 for v in losses.values())
    with torch.no_grad():
        rtn_error = float((rtn(held_out) - expected).square().mean())
        gptq_logits = gptq(held_out)
    assert float((gptq_logits - expected).square().mean()) < rtn_error
    assert all(m.compute == "auto" for m in gptq.modules() if isinstance(m, QuantizedLinear))
    assert gptq.config.extra["quantization_config"]["method"] == "gptq"
    save_quantized(gptq, tmp_path / "q", char_tokenizer())
    loaded = load_quantized_dir(tmp_path / "q")
    with torch.no_grad():
        assert torch.equal(loaded(held_out), gptq_logits)


def test_true_sequential_stages_follow_the_forward():
    from posttrain.quant.gptq_model import _stages

    model = tiny_model()
    layer = model.layers[0]
    linears = {n: m for n, m in layer.named_modules() if n.endswith("_proj")}
    positions = torch.arange(8)[None, :]
    cos, sin = model.rotary(positions)
    from posttrain.models.attention import DenseAttentionMetadata

    stages = _stages(
        linears, lambda collector: layer(torch.randn(2, 8, 64), cos, sin, DenseAttentionMetadata(None, positions))
    )
    assert stages == [
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        ["self_attn.o_proj"],
        ["mlp.gate_proj", "mlp.up_proj"],
        ["mlp.down_proj"],
    ]
    calibration = torch.randint(3, 128, (4, 16))
    one_pass, staged = tiny_model(), tiny_model()
    gptq_quantize_model(one_pass, "int8", calibration, true_sequential=False)
    gptq_quantize_model(staged, "int8", calibration, true_sequential=True)
    first = one_pass.layers[0].self_attn
    assert torch.equal(first.q_proj.qweight, staged.layers[0].self_attn.q_proj.qweight)  # same float inputs
    assert not torch.equal(first.o_proj.qweight, staged.layers[0].self_attn.o_proj.qweight)  # quantized q/k/v


def test_model_errors():
    model = quantize_model(tiny_model(), "int8")
    with pytest.raises(PosttrainError, match="layers.0.self_attn.q_proj is a QuantizedLinear, not nn.Linear"):
        gptq_quantize_model(model, "int4-g32", torch.randint(3, 128, (2, 8)))
    with pytest.raises(PosttrainError, match="calibration_ids must be \\(samples, seq_len\\) int64"):
        gptq_quantize_model(tiny_model(), "int4-g32", torch.zeros(8, dtype=torch.long))


class _TwoStages(torch.nn.Module):
    """`second`'s input is made right after `first`'s is freed, with its shape: the allocator may hand it the
    same address (o_proj after q/k/v's normed input, in a decoder layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(64, 64, bias=False)
        self.second = torch.nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x * 2.0)  # the product is freed once `first` returns
        return self.second(h + 1.0)


def test_hessians_of_linears_fed_different_tensors_stay_apart_when_an_address_is_reused():
    from posttrain.quant.gptq_model import _HessianCollector

    torch.manual_seed(0)
    model, x = _TwoStages(), torch.randn(64, 48, 64)  # 786 KB inputs: glibc hands a freed block of that size back
    with torch.no_grad():
        model(x)  # warm the allocator: from now on the product's freed block is what `h + 1` gets
        collector = _HessianCollector({"first": model.first, "second": model.second})
        collector.new_forward()
        model(x)
        collector.close()
        first_input = (x * 2.0).reshape(-1, 64)
        second_input = model.first(first_input) + 1.0
    assert "second" not in collector.alias
    torch.testing.assert_close(collector.sums["first"], (first_input.T @ first_input).double())
    torch.testing.assert_close(collector.sums["second"], (second_input.T @ second_input).double())
