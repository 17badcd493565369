"""The engine in bf16 over fp32 master weights (EngineConfig.compute_dtype, posttrain/engine/bf16_weights.py):
auto keeps the fp32 path on a CPU without fast bf16 and picks bf16 on one with it (both forced); the bf16 copies
follow the weights (an optimizer step, a sleep); the KV pool takes half the bytes; greedy outputs and logprobs stay
close to the fp32 engine's, with the C kernels and without. Tiny random models: bf16 matmuls are emulated (slow)
on an AVX2 CPU, and these are small."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from posttrain import kernels
from posttrain.engine import LLM, SamplingParams
from posttrain.engine.bf16_weights import Bf16Weights
from posttrain.engine.config import EngineConfig, EngineConfigError
from posttrain.errors import PosttrainError
from posttrain.hardware import FEATURES_ENV
from posttrain.quant import linear as quant_linear
from tests.engine.tiny import CharTokenizer, make_llm, tiny_model

AVX2 = "avx avx2 fma"
ZEN5 = "avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni"
PROMPTS = ["hello world", "abc", "xyzzy12345", "0123", "kkkk", "posttrain", "q", "some longer prompt here"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=True, ignore_eos=True)
BF16_ROUNDOFF = 2.0**-9  # bf16 keeps 8 significant bits: a rounding moves a value by at most 2^-9 of it


def bf16_logit_tolerance(model: torch.nn.Module, largest_logit: float) -> float:
    """How far the bf16 engine's logits (and so twice that, its logprobs) may lie from fp32's on the same tokens.
    Every linear layer rounds its input, its weight and its output to bf16 (3 roundings), the K/V pool rounds K and
    V (2 per layer): along the path to a logit, per layer q/k/v, o_proj, gate/up, down (4 linears in sequence, 12
    roundings) + 2 for the pool, then the LM head's 3. As in tests/numeric.py, independent zero-mean rounding
    errors add like a random walk, and 12 standard deviations (u * sqrt(N / 3) each) bound them, relative to the
    largest logit (the size of the terms the errors are measured against)."""
    roundings = 14 * model.config.num_hidden_layers + 3
    return 12 * math.sqrt(roundings / 3) * BF16_ROUNDOFF * largest_logit


def greedy(llm: LLM, prompts: list[str] = PROMPTS) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]


def prompt_logprobs(llm: LLM, token_ids: list[list[int]]) -> list[list[float]]:
    """Teacher-forced logprobs of each prompt's tokens (identical tokens for both engines)."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    return [[entry for entry in out.prompt_logprobs[1:]] for out in llm.generate(token_ids, params)]


# ---- config and resolution ----------------------------------------------------------------------------------------


def test_a_bad_compute_dtype_names_the_key():
    with pytest.raises(EngineConfigError, match="compute_dtype='float16'"):
        EngineConfig(compute_dtype="float16")
    bf16_model = tiny_model().to(torch.bfloat16)
    with pytest.raises(PosttrainError, match="compute_dtype='float32': the model's weights are bfloat16"):
        make_llm(bf16_model, compute_dtype="float32")


def test_auto_without_fast_bf16_is_the_fp32_path_bit_for_bit(monkeypatch):
    monkeypatch.setenv(FEATURES_ENV, AVX2)
    model = tiny_model()
    auto = make_llm(model)  # compute_dtype defaults to auto
    assert auto.compute_dtype == torch.float32
    assert auto.engine.runner.bf16_weights is None
    assert auto.engine.runner.kv_caches[0].dtype == torch.float32
    auto_outputs = auto.generate(PROMPTS, GREEDY)
    fp32_outputs = make_llm(model, compute_dtype="float32").generate(PROMPTS, GREEDY)
    for a, b in zip(auto_outputs, fp32_outputs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # exactly: one code path


def test_auto_with_fast_bf16_computes_in_bf16_and_float32_stays_fp32(monkeypatch):
    monkeypatch.setenv(FEATURES_ENV, ZEN5)
    model = tiny_model()
    llm = make_llm(model)
    assert llm.compute_dtype == torch.bfloat16
    assert llm.engine.runner.kv_caches[0].dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the master weights are untouched
    assert make_llm(model, compute_dtype="float32").compute_dtype == torch.float32
    # bf16 weights compute in bf16 whatever auto finds, with no copies
    bf16 = make_llm(tiny_model().to(torch.bfloat16))
    assert bf16.compute_dtype == torch.bfloat16 and bf16.engine.runner.bf16_weights is None


# ---- the copies ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_is_the_bf16_product_in_fp32(bias: bool):
    torch.manual_seed(0)
    weight, x = torch.randn(24, 40), torch.randn(3, 5, 40)
    b = torch.randn(24) if bias else None
    copies = Bf16Weights()
    out = copies.linear(x, weight, b)
    assert out.dtype == torch.float32 and out.shape == (3, 5, 24)
    expected = F.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16)).float()
    assert torch.equal(out, expected + b if bias else expected)
    assert copies.linear(x.double(), weight.double(), None) is None  # not fp32: left to F.linear
    assert copies.num_held == 1


@pytest.mark.skipif(kernels.library() is None, reason="the native CPU kernels are not built here")
def test_packed_copies_take_the_native_kernel_at_every_size():
    """With the native kernels the copies are packed and every product, one row or a prefill's many, goes through
    bf16_linear.c (a bias in fp32 after it); the runner packs with the native kernels only."""
    torch.manual_seed(0)
    weight, b = torch.randn(48, 64), torch.randn(48)
    copies = Bf16Weights(packed=True)
    for x in (torch.randn(2, 2, 64), torch.randn(300, 64)):  # leading dims flattened; more rows than a chunk
        rows = x.numel() // 64
        out = copies.linear(x, weight, b)
        assert out.shape == (*x.shape[:-1], 48)
        want = kernels.bf16_linear(x.reshape(rows, 64), kernels.bf16_pack(weight), 48, b).view(*x.shape[:-1], 48)
        assert torch.equal(out, want)
    assert copies.num_held == 1 and copies.bytes_held == 64 * 64 * 2  # one packed copy, 48 outputs padded to 64
    half_bias = copies.linear(torch.randn(3, 64), weight, b.bfloat16())  # a bf16 bias: added after, as F.linear
    assert half_bias.dtype == torch.float32 and half_bias.shape == (3, 48)
    assert make_llm(tiny_model(), compute_dtype="bfloat16").engine.runner.bf16_weights.packed
    plain = make_llm(tiny_model(), compute_dtype="bfloat16", cpu_kernels=False)
    assert not plain.engine.runner.bf16_weights.packed


def test_copies_follow_an_optimizer_step_and_the_engine_sees_it():
    """The trainer steps the live fp32 module in place: the engine's next forward computes with remade copies, and
    its logprobs are those of a fresh bf16 engine over the updated weights, exactly."""
    model = tiny_model()
    llm = make_llm(model, compute_dtype="bfloat16")
    tokens = [llm.encode_prompt(p)[1] for p in PROMPTS[:4]]
    before = prompt_logprobs(llm, tokens)
    copies = llm.engine.runner.bf16_weights
    made = copies.num_copies_made
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    logits = model(torch.tensor([tokens[0]]))
    F.cross_entropy(logits[0, :-1], torch.tensor(tokens[0][1:])).backward()
    optimizer.step()
    llm.weights_updated()
    after = prompt_logprobs(llm, tokens)
    assert copies.num_copies_made > made
    assert after != before
    fresh = prompt_logprobs(make_llm(copy.deepcopy(model), compute_dtype="bfloat16"), tokens)
    assert after == fresh


def test_an_in_place_change_is_seen_without_weights_updated():
    """Version counters: a weight written in place (no weights_updated call) gets a new copy at the next forward."""
    model = tiny_model()
    llm = make_llm(model, compute_dtype="bfloat16", enable_prefix_caching=False)
    tokens = [llm.encode_prompt("hello world")[1]]
    before = prompt_logprobs(llm, tokens)
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight.mul_(3)
    after = prompt_logprobs(llm, tokens)
    assert after != before
    assert after == prompt_logprobs(make_llm(copy.deepcopy(model), compute_dtype="bfloat16"), tokens)


def test_copies_are_dropped_on_sleep_and_remade_after_wake():
    llm = make_llm(compute_dtype="bfloat16")
    greedy(llm, PROMPTS[:2])
    copies = llm.engine.runner.bf16_weights
    # 2 layers x 7 linears + the LM head (tied or not, one copy per weight tensor)
    assert copies.num_held == 15
    shapes = [m.weight.shape for m in llm.engine.model.modules() if isinstance(m, torch.nn.Linear)]
    if copies.packed:  # padded to blocks of 64 outputs and pairs of inputs
        shapes = [(-(-n // 64) * 64, -(-k // 2) * 2) for n, k in shapes]
    assert copies.bytes_held == sum(n * k * 2 for n, k in shapes)
    llm.sleep()
    assert copies.num_held == 0
    llm.wake()
    greedy(llm, PROMPTS[:2])
    assert copies.num_held == 15


def test_the_bf16_kv_pool_takes_half_the_bytes():
    model = tiny_model()
    fields = dict(block_size=4, max_num_seqs=16, max_num_batched_tokens=24, kv_cache_bytes=1 << 16)
    fp32 = LLM(model, CharTokenizer(), compute_dtype="float32", **fields)
    bf16 = LLM(model, CharTokenizer(), compute_dtype="bfloat16", **fields)
    assert bf16.engine.num_blocks == 2 * fp32.engine.num_blocks  # the same byte budget holds twice the blocks
    fixed = dict(fields, kv_cache_bytes=None, num_kv_blocks=64)
    sizes = [
        sum(
            c.numel() * c.element_size()
            for c in LLM(model, CharTokenizer(), compute_dtype=d, **fixed).engine.runner.kv_caches
        )
        for d in ("float32", "bfloat16")
    ]
    assert sizes[1] * 2 == sizes[0]


# ---- the whole engine against fp32 --------------------------------------------------------------------------------


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_bf16_engine_matches_fp32_for_the_most_part(cpu_kernels: bool):
    """Greedy paths: most prompts give fp32's tokens (a near-tie may flip; this tiny model's sharpened logits make
    few). Logprobs of identical tokens (teacher-forced): within the derived bf16 bound of fp32's."""
    model = tiny_model()
    fp32 = make_llm(model, compute_dtype="float32", cpu_kernels=cpu_kernels)
    bf16 = make_llm(model, compute_dtype="bfloat16", cpu_kernels=cpu_kernels)
    fp32_paths, bf16_paths = greedy(fp32), greedy(bf16)
    same = sum(a == b for a, b in zip(fp32_paths, bf16_paths)) / len(PROMPTS)
    assert same >= 0.75, same
    tokens = [fp32.encode_prompt(p)[1] + path for p, path in zip(PROMPTS, fp32_paths)]
    with torch.no_grad():
        largest_logit = max(model(torch.tensor([t])).abs().max().item() for t in tokens)
    tolerance = 2 * bf16_logit_tolerance(model, largest_logit)
    reference, ours = prompt_logprobs(fp32, tokens), prompt_logprobs(bf16, tokens)
    error = max(abs(a - b) for row_a, row_b in zip(reference, ours) for a, b in zip(row_a, row_b))
    assert 0 < error <= tolerance, (error, tolerance)


def test_the_c_kernels_and_the_pytorch_path_agree_in_bf16():
    """Both read the same bf16 pool through the same bf16 linears; they differ in fp32 summation order, which a
    later bf16 rounding may amplify to one bf16 step: held to the same bound."""
    model = tiny_model()
    tokens = [[1 + (i * 7 + j) % 60 for j in range(5 + 3 * i)] for i in range(6)]
    native = prompt_logprobs(make_llm(model, compute_dtype="bfloat16"), tokens)
    plain = prompt_logprobs(make_llm(model, compute_dtype="bfloat16", cpu_kernels=False), tokens)
    with torch.no_grad():
        largest_logit = max(model(torch.tensor([t])).abs().max().item() for t in tokens)
    tolerance = 2 * bf16_logit_tolerance(model, largest_logit)
    assert max(abs(a - b) for ra, rb in zip(native, plain) for a, b in zip(ra, rb)) <= tolerance


@pytest.mark.parametrize("packed", [False, True])
def test_a_weight_made_inside_the_forward_is_copied_for_its_call_and_not_kept(packed: bool):
    """A quantized layer on the reference kernel dequantizes its weight in the forward, under the engine's
    inference mode: such a weight has no version counter to watch, so its bf16 copy is not kept."""
    if packed and kernels.library() is None:
        pytest.skip("the native CPU kernels are not built here")
    torch.manual_seed(0)
    x = torch.randn(3, 40)
    with torch.inference_mode():
        weight = torch.randn(24, 40)
    copies = Bf16Weights(packed)
    if packed:
        expected = kernels.bf16_linear(x, kernels.bf16_pack(weight), 24)
    else:
        expected = F.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16)).float()
    assert torch.equal(copies.linear(x, weight, None), expected)
    assert copies.num_held == 0


def test_a_bf16_engine_runs_a_quantized_model_on_the_reference_kernel(monkeypatch):
    monkeypatch.setattr(quant_linear, "KERNEL_ORDER", ("reference",))
    model = quant_linear.quantize_model(tiny_model(), "int8")
    llm = make_llm(model, compute_dtype="bfloat16")
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4
