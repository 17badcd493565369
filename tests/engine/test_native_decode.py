"""The whole decoder of a few-row decode step in one native call (posttrain/engine/native_decode.py,
posttrain/kernels/decode_step.c): bit for bit the module path, and only where it applies."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from posttrain import kernels
from posttrain.engine import SamplingParams
from posttrain.engine.config import EngineConfigError
from posttrain.engine.native_decode import supports_model
from posttrain.engine.small_rows_linear import MAX_ROWS
from posttrain.models.transformer import Transformer
from posttrain.quant.inference import quantize_for_inference
from tests.engine.tiny import make_llm, tiny_model

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="the native CPU kernels are not built here")

PROMPTS = ["123", "45678", "9:;<=>?@A"]


def variant(kind: str, seed: int = 0) -> Transformer:
    """The tiny model, or a sibling with Qwen2's q/k/v biases or Qwen3's per-head q/k norms."""
    base = tiny_model(seed)
    if kind == "llama":
        return base
    cfg = dataclasses.replace(base.config, attention_bias=kind == "qwen2", qk_norm=kind == "qwen3")
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
        for p in model.parameters():  # norms and biases away from their init, so a skipped one shows
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def generate(llm, n: int = 2, **params):  # noqa: ANN001, ANN201
    sp = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2, n=n, seed=7, **params)
    outs = llm.generate(PROMPTS, sp)
    return [(c.token_ids, c.logprobs) for out in outs for c in out.outputs]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decode_is_bit_for_bit_the_module_path(kind: str, temperature: float) -> None:
    """Greedy and sampled, 6 sequences decoding together (in groups sharing their prompt's blocks): the same
    tokens and the very same logprobs with and without the native step."""
    model = variant(kind)
    native = make_llm(model)
    got = generate(native, temperature=temperature)
    assert native.engine.runner.native_decode.steps >= 10  # it ran the decode steps
    plain = make_llm(model, native_decode_step=False)
    assert plain.engine.runner.native_decode is None
    assert got == generate(plain, temperature=temperature)


@pytest.mark.parametrize("quant", ["int8", "q8_0"])
def test_int8_layers_are_bit_for_bit_the_module_path(quant: str) -> None:
    """int8_linear.c, and q8_linear.c for q8_0 (every layer's input a multiple of its groups of 32)."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(tiny_model().config, hidden_size=64, num_attention_heads=8)).eval()
    quantize_for_inference(model, quant)
    probe = torch.empty(1, 64)
    kernel = "cpu_q8_native" if quant == "q8_0" else "cpu_int8_native"
    assert {m.kernel_for(probe).name for n, m in model.named_modules() if n.endswith(("q_proj", "gate_proj"))} == {
        kernel
    }
    assert generate(make_llm(model)) == generate(make_llm(model, native_decode_step=False))
    llm = make_llm(model)
    generate(llm)
    assert llm.engine.runner.native_decode.steps > 0


def test_steps_with_more_rows_take_the_module_path() -> None:
    llm = make_llm()
    sp = SamplingParams(max_tokens=4, ignore_eos=True, n=MAX_ROWS + 1, seed=0)
    llm.generate(["123"], sp)
    assert llm.engine.runner.native_decode.steps == 1  # the 3-token prefill; never the 9-row decode steps
    llm.generate(["45"], SamplingParams(max_tokens=4, ignore_eos=True, n=MAX_ROWS, seed=0))
    assert llm.engine.runner.native_decode.steps == 1 + 4  # its prefill and 3 decode steps of 8 rows
    llm.generate(["0123456789"], SamplingParams(max_tokens=1))
    assert llm.engine.runner.native_decode.steps == 5  # a 10-token prefill: the modules


def logits_by_position(llm) -> dict[int, torch.Tensor]:  # noqa: ANN001
    """Records the logits the engine's forwards give at each position sampled from (one sequence)."""
    runner, seen = llm.engine.runner, {}
    execute = runner.execute

    def recording(batch):  # noqa: ANN001, ANN202
        positions = runner.prepare(batch)
        out = execute(batch)
        for position, row in zip(positions.positions[positions.sample_index].tolist(), out.logits):
            seen[position] = row.clone()
        return out

    runner.execute = recording
    return seen


def test_speculative_checks_are_exactly_plain_decoding_at_batch_1() -> None:
    """A check of k drafts runs each position as a decode query would: at batch 1 every position's logits are bit
    for bit the plain engine's (the module path checks drafts with masked SDPA instead, equal only to rounding), so
    the greedy tokens are too."""
    model = tiny_model(0)  # falls into a loop: the n-gram drafts are accepted often
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain_llm = make_llm(model, decode_steps=1)  # every position through runner.execute (no chained steps)
    plain_logits = logits_by_position(plain_llm)
    plain = plain_llm.generate([prompt], sp)[0].outputs[0].token_ids
    spec = make_llm(model, speculative={"method": "ngram", "num_tokens": 4}, decode_steps=1)
    spec_logits = logits_by_position(spec)
    got = spec.generate([prompt], sp)[0].outputs[0].token_ids
    assert spec.stats()["spec_accepted_tokens"] > 10
    assert spec.engine.runner.native_decode.steps == spec.stats()["steps"] - 1  # every check, not the prefill
    assert got == plain
    checked = [p for p in spec_logits if p in plain_logits]
    assert len(checked) == len(plain_logits)  # every position the plain engine sampled, the checks computed
    assert all(torch.equal(spec_logits[p], plain_logits[p]) for p in checked)


def test_short_prompts_match_the_module_path_to_rounding() -> None:
    """A prompt of a few tokens runs as one query per token (causal: each sees its context up to itself). Its prompt
    logprobs equal the module path's (masked SDPA) to rounding: 1e-4 is far above fp32's reordered sums through two
    layers (~1e-6 here) and far below what one position seen too many or too few does (~1e-1)."""
    model = variant("qwen3")
    sp = SamplingParams(max_tokens=1, prompt_logprobs=2)
    native_llm = make_llm(model)
    native = native_llm.generate(["9:;<=>?"], sp)[0].prompt_logprobs
    assert native_llm.engine.runner.native_decode.steps == 1
    plain = make_llm(model, native_decode_step=False).generate(["9:;<=>?"], sp)[0].prompt_logprobs
    assert native[0] is None and plain[0] is None
    torch.testing.assert_close(torch.tensor(native[1:]), torch.tensor(plain[1:]), atol=1e-4, rtol=0)


def test_it_sees_weights_changed_in_place_and_replaced() -> None:
    """An optimizer's in-place step is read live; a new tensor (a loader's assignment) rebuilds the table."""
    model = tiny_model()
    native, plain = make_llm(model), make_llm(model, native_decode_step=False)
    before = generate(native, temperature=0.0)
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight.mul_(-3.0)  # in place
    native.weights_updated()  # the contract: the prefix cache goes (its blocks hold the old weights' K/V)
    changed = generate(native, temperature=0.0)
    assert changed != before and changed == generate(plain, temperature=0.0)
    model.layers[0].self_attn.q_proj.weight = nn.Parameter(torch.randn_like(model.layers[0].self_attn.q_proj.weight))
    native.weights_updated(), plain.weights_updated()
    replaced = generate(native, temperature=0.0)
    assert replaced != changed and replaced == generate(plain, temperature=0.0)


def test_a_layer_it_does_not_know_sends_every_step_to_the_modules() -> None:
    """A wrapper around a linear layer (as LoRA puts there) must run: the native step stands aside."""

    class Doubled(nn.Module):
        def __init__(self, inner: nn.Linear) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * self.inner(x)

    model = tiny_model()
    native = make_llm(model)
    generate(native)
    ran = native.engine.runner.native_decode.steps
    model.layers[1].mlp.up_proj = Doubled(model.layers[1].mlp.up_proj)
    native.weights_updated()
    wrapped = generate(native, temperature=0.0)
    assert native.engine.runner.native_decode.steps == ran
    assert wrapped == generate(make_llm(model, native_decode_step=False), temperature=0.0)


def test_models_it_does_not_compute_are_refused_up_front() -> None:
    assert supports_model(tiny_model())
    windowed = Transformer(dataclasses.replace(tiny_model().config, sliding_window=8))
    assert not supports_model(windowed)
    assert make_llm(tiny_model().to(torch.bfloat16)).engine.runner.native_decode is None  # bf16 weights
    assert make_llm(tiny_model(), compute_dtype="bfloat16").engine.runner.native_decode is not None  # bf16 copies
    assert make_llm(tiny_model(), cpu_kernels=False).engine.runner.native_decode is None


def test_bad_flag_is_one_clear_error() -> None:
    with pytest.raises(EngineConfigError, match="native_decode_step='yes': must be true or false"):
        make_llm(native_decode_step="yes")


def test_forward_hooks_send_the_step_to_the_modules() -> None:
    """Hooks must run (FSDP2 all-gathers a layer's shards in one, torchrun's rollout lockstep counts working ranks in
    another): with a hook on any module the native step would skip, the modules run."""
    model = tiny_model()
    llm = make_llm(model)
    calls: list[int] = []
    handle = model.layers[1].self_attn.register_forward_pre_hook(lambda module, args: calls.append(1))
    generate(llm)
    assert llm.engine.runner.native_decode.steps == 0 and len(calls) > 10
    handle.remove()
    generate(llm)
    assert llm.engine.runner.native_decode.steps > 0


def test_changes_without_weights_updated_are_seen_at_the_next_step() -> None:
    """The table's watch (checked at every step in place of the whole fingerprint) must catch what the fingerprint
    catches when nobody calls weights_updated(): a hook put on after the table was built, a module swapped for a
    wrapper, a weight given new storage."""
    model = tiny_model()
    llm = make_llm(model, enable_prefix_caching=False)
    plain = make_llm(model, native_decode_step=False, enable_prefix_caching=False)
    runner = llm.engine.runner
    generate(llm)
    assert runner.native_decode._table is not None
    steps = runner.native_decode.steps
    calls: list[int] = []
    handle = model.layers[0].mlp.gate_proj.register_forward_hook(lambda module, args, out: calls.append(1))
    generate(llm)
    assert runner.native_decode.steps == steps and calls  # the hook ran: the modules did
    handle.remove()
    generate(llm)
    assert runner.native_decode.steps > steps
    table, down = runner.native_decode._table, model.layers[1].mlp.down_proj
    with torch.no_grad():
        down.weight.data = torch.randn_like(down.weight)  # the same Parameter over new storage
    assert generate(llm, temperature=0.0) == generate(plain, temperature=0.0)
    assert runner.native_decode._table is not None and runner.native_decode._table is not table  # rebuilt
    steps = runner.native_decode.steps
    model.layers[1].mlp.down_proj = nn.Sequential(down)  # a wrapper the native step does not compute
    assert generate(llm, temperature=0.0) == generate(plain, temperature=0.0)
    assert runner.native_decode.steps == steps
