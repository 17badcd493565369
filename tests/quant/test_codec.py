"""Round-to-nearest quantization, int4 packing and the scheme registry, on hand-checkable tensors."""

from __future__ import annotations

import pytest
import torch

from posttrain.errors import PosttrainError
from posttrain.quant import SCHEMES, QuantScheme, dequantize_weight, get_scheme, pack_int4, quantize_weight, unpack_int4
from posttrain.quant.codec import (
    fake_quantize,
    fake_quantize_activations,
    fake_quantize_per_token,
    quantize_per_group,
    quantize_per_token,
)

WEIGHT_ONLY = [name for name, s in SCHEMES.items() if s.activation_bits is None]


def round_trip(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    codes, scales, zeros = quantize_weight(w, scheme)
    return dequantize_weight(codes, scales, zeros, scheme.group_size)


# ---- the registry ---------------------------------------------------------------------------------------


def test_registry_names_and_fields():
    assert list(SCHEMES) == [
        "int8",
        "int8-g32",
        "int8-asym",
        "w8a8",
        "q8_0",
        "int4-g32",
        "int4-g32-asym",
        "int4-g64",
        "int4-g64-asym",
        "int4-g128",
        "int4-g128-asym",
    ]
    s = get_scheme("int4-g128-asym")
    assert (s.bits, s.group_size, s.symmetric, s.q_min, s.q_max) == (4, 128, False, -8, 7)
    assert (get_scheme("int8").q_min, get_scheme("int8").q_max) == (-128, 127)
    assert get_scheme("w8a8").activation_bits == 8
    assert (get_scheme("q8_0").group_size, get_scheme("q8_0").activation_bits) == (32, 8)  # llama.cpp's Q8_0
    assert get_scheme(s) is s


@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda: get_scheme("int3"), "unknown quantization scheme 'int3' (choose from int8, int8-g32, int8-asym"),
        (lambda: QuantScheme("x", 3, None, True), "bits=3"),
        (lambda: QuantScheme("x", 4, 1, True), "group_size=1 must be an integer >= 2"),
        (lambda: QuantScheme("x", 4, True, True), "group_size=True"),
        (lambda: QuantScheme("x", 4, 32, True, activation_bits=8), "int8 activations need symmetric int8 weights"),
        (lambda: QuantScheme("x", 8, None, True, activation_bits=4), "activation_bits=4"),
    ],
)
def test_bad_schemes(make, problem):
    with pytest.raises(PosttrainError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        make()


# ---- exact values round-trip exactly -----------------------------------------------------------------------


def test_int8_symmetric_grid_is_exact():
    w = (torch.arange(-128, 128, dtype=torch.float32) * 0.25).view(1, -1)  # largest magnitude -32 -> code -128
    codes, scales, zeros = quantize_weight(w, get_scheme("int8"))
    assert zeros is None and scales.dtype == torch.float32 and scales.item() == 0.25
    assert torch.equal(codes, torch.arange(-128, 128, dtype=torch.int8).view(1, -1))
    assert torch.equal(round_trip(w, get_scheme("int8")), w)


def test_int4_symmetric_grid_is_exact_per_group():
    # The value of largest magnitude becomes code -8: scale = that value / -8 (negative if the value is positive).
    group = torch.cat([torch.arange(-8, 8, dtype=torch.float32), torch.zeros(16)])  # codes -8..7, then zeros
    w = torch.stack([torch.cat([group * 0.5, group * 0.125]), torch.cat([group * 2.0, -group])])  # (2, 64)
    codes, scales, zeros = quantize_weight(w, get_scheme("int4-g32"))
    assert scales.dtype == torch.float16
    assert scales.float().tolist() == [[0.5, 0.125], [2.0, -1.0]]  # -group's extreme is +8: scale -1
    assert codes[0, :16].tolist() == list(range(-8, 8)) and codes[1, 32:48].tolist() == list(range(-8, 8))
    assert torch.equal(round_trip(w, get_scheme("int4-g32")), w)


def test_int4_asymmetric_zero_point_by_hand():
    # Group values -1 + 0.25 * c for c = 0..15 (twice): min -1, max 2.75, so scale 3.75 / 15 = 0.25 and the
    # zero point (the value of centred code 0, i.e. unsigned code 8) is -1 + 8 * 0.25 = 1.0.
    grid = -1 + 0.25 * torch.arange(16, dtype=torch.float32)
    w = torch.cat([grid, grid.flip(0)]).view(1, 32)
    codes, scales, zeros = quantize_weight(w, get_scheme("int4-g32-asym"))
    assert scales.item() == 0.25 and zeros.item() == 1.0
    assert codes[0, :16].tolist() == list(range(-8, 8))
    assert torch.equal(round_trip(w, get_scheme("int4-g32-asym")), w)


def test_int8_asymmetric_zero_point_by_hand():
    w = (-10 + 0.125 * torch.arange(256, dtype=torch.float32)).view(1, -1)  # [-10, 21.875]: scale 0.125
    codes, scales, zeros = quantize_weight(w, get_scheme("int8-asym"))
    assert scales.item() == 0.125 and zeros.item() == -10 + 128 * 0.125  # 6.0
    assert codes.tolist() == [list(range(-128, 128))]
    assert torch.equal(round_trip(w, get_scheme("int8-asym")), w)


@pytest.mark.parametrize("name", WEIGHT_ONLY)
def test_zero_rows_and_constant_groups_are_exact(name):
    scheme = get_scheme(name)
    w = torch.zeros(4, 64)
    w[1] = 0.3  # constant row: positive
    w[2] = -1.7  # constant row: negative
    out = round_trip(w, scheme)
    if scheme.symmetric:
        assert torch.equal(out[0], w[0]) and torch.allclose(out[1:3], w[1:3], rtol=1e-3)  # absmax on the grid
    else:
        assert torch.equal(out[0], w[0]) and torch.allclose(out[1:3], w[1:3], rtol=1e-3)


# ---- error bounds on random weights ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", WEIGHT_ONLY)
def test_round_trip_error_is_at_most_half_a_step(name):
    scheme = get_scheme(name)
    torch.manual_seed(0)
    w = torch.randn(70, 200) * torch.linspace(0.01, 3, 70)[:, None]  # rows of very different scale; 200 = ragged
    codes, scales, zeros = quantize_weight(w, scheme)
    G = scheme.num_groups(200)
    assert codes.shape == (70, 200) and scales.shape == (70, G)
    assert int(codes.min()) >= scheme.q_min and int(codes.max()) <= scheme.q_max
    step = scales.float().abs().repeat_interleave(scheme.effective_group_size(200), dim=1)[:, :200]
    err = (dequantize_weight(codes, scales, zeros, scheme.group_size) - w).abs()
    # Half a step, plus the rounding of fp16 scales / zero points when the extreme values clamp; on a
    # symmetric grid a value opposite the extreme past +7.5 steps clamps to +7: up to one step.
    slack = 1e-3 * w.abs().amax(dim=1, keepdim=True)
    bound = torch.where((codes == scheme.q_max) & scheme.symmetric, step, step / 2) * (1 + 1e-5) + slack
    assert bool((err <= bound).all()), float((err - bound).max())
    rel = (err.norm() / w.norm()).item()
    assert rel < (0.01 if scheme.bits == 8 else 0.12)


def test_short_last_group_uses_its_own_range():
    w = torch.ones(1, 80)
    w[0, 64:] = 0.01  # the last group (16 of 32) is small: its scale must not come from the others
    codes, scales, _ = quantize_weight(w, get_scheme("int4-g32"))
    assert scales.shape == (1, 3)
    assert scales.float()[0].tolist() == pytest.approx([-1 / 8, -1 / 8, -0.01 / 8], rel=1e-3)
    assert torch.allclose(round_trip(w, get_scheme("int4-g32")), w, rtol=1e-3)


def test_asymmetric_beats_symmetric_on_one_sided_weights():
    torch.manual_seed(0)
    w = torch.rand(16, 128)  # all positive: a symmetric grid wastes half its codes
    err = {n: (round_trip(w, get_scheme(n)) - w).norm().item() for n in ("int4-g32", "int4-g32-asym")}
    assert err["int4-g32-asym"] < 0.6 * err["int4-g32"]


def test_bad_weights():
    with pytest.raises(PosttrainError, match="layer.x: expected a 2-D float weight"):
        quantize_weight(torch.ones(4), get_scheme("int8"), "layer.x")
    with pytest.raises(PosttrainError, match="layer.x: scales do not fit in torch.float16"):
        quantize_weight(torch.full((2, 32), 1e6), get_scheme("int4-g32"), "layer.x")
    with pytest.raises(PosttrainError, match="scales do not fit"):
        quantize_weight(torch.tensor([[1.0, float("nan")]]), get_scheme("int8"))


def test_fake_quantize_is_quantize_then_dequantize_in_the_weight_dtype():
    torch.manual_seed(0)
    w = torch.randn(8, 64, dtype=torch.bfloat16)
    out = fake_quantize(w, get_scheme("int4-g32"))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, round_trip(w, get_scheme("int4-g32")).to(torch.bfloat16))


# ---- int4 packing -------------------------------------------------------------------------------------------


def test_pack_int4_layout_by_hand():
    codes = torch.zeros(64, 3, dtype=torch.int8)
    codes[0, 0], codes[32, 0], codes[1, 2], codes[63, 1] = 7, -8, 1, -1
    packed = pack_int4(codes)
    assert packed.shape == (1, 3, 32) and packed.dtype == torch.uint8
    assert packed[0, 0, 0].item() == 0x0F  # low nibble: row 0 (7 + 8); high nibble: row 32 (-8 + 8)
    assert packed[0, 2, 1].item() == 0x89  # row 1 (1 + 8 = 9) low, row 33 (0 + 8) high
    assert packed[0, 1, 31].item() == 0x78  # row 31 (8) low, row 63 (-1 + 8 = 7) high
    assert int((packed == 0x88).sum()) == 3 * 32 - 3  # every other byte holds two zero codes


@pytest.mark.parametrize("rows", [1, 64, 100, 192])
def test_pack_unpack_round_trip(rows):
    torch.manual_seed(rows)
    codes = torch.randint(-8, 8, (rows, 50), dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.shape == (-(-rows // 64), 50, 32)  # two codes per byte, rows padded to a tile of 64
    assert torch.equal(unpack_int4(packed, rows), codes)


# ---- activations -----------------------------------------------------------------------------------------------


def test_per_token_activation_quantization():
    x = torch.tensor([[1.27, -0.635, 0.0], [0.0, 0.0, 0.0], [-254.0, 127.0, 1.0]])
    codes, scales = quantize_per_token(x)
    assert codes.dtype == torch.int8 and scales.shape == (3, 1)
    assert codes.tolist() == [[127, -64, 0], [0, 0, 0], [-127, 64, 0]]  # round half to even: -63.5 -> -64
    assert scales[:, 0].tolist() == pytest.approx([0.01, 1e-12, 2.0])
    assert torch.equal(fake_quantize_per_token(x)[1], x[1])  # a zero row stays zero


def test_per_group_activation_quantization():
    """A scale per group of `group` inputs along each row (a short last group too): each group's largest magnitude
    becomes code +-127 whatever the other groups hold (per token, the small group would round to zeros)."""
    x = torch.tensor([[1.27, -0.635, 254.0, 127.0, 3.0], [0.0, 0.0, -254.0, 127.0, 0.0]])
    codes, scales = quantize_per_group(x, 2)
    assert codes.dtype == torch.int8 and scales.shape == (2, 3)
    assert codes.tolist() == [[127, -64, 127, 64, 127], [0, 0, -127, 64, 0]]  # half to even: 63.5 -> 64
    assert scales.flatten().tolist() == pytest.approx([0.01, 2.0, 3 / 127, 1e-12, 2.0, 1e-12])
    scheme = get_scheme("q8_0")
    y = torch.randn(3, 4, 96) * torch.tensor([1e-3, 1.0, 1e3]).repeat_interleave(32)
    rounded = fake_quantize_activations(y, scheme)
    assert rounded.shape == y.shape
    step = y.view(3, 4, 3, 32).abs().amax(-1, keepdim=True) / 127  # each group's own grid: at most half a step off
    assert ((rounded - y).view(3, 4, 3, 32).abs() <= step * (0.5 + 1e-6)).all()
    assert torch.equal(
        fake_quantize_activations(y, get_scheme("w8a8")), fake_quantize_per_token(y.view(12, 96)).view_as(y)
    )
