"""Weight-only int8 for the inference commands (`generate`, `chat`, `serve` with `--quant int8`, and
`LLM(model=..., quant="int8")`): the decoder's linear weights are rounded to int8 in groups of 32 along each row
with an fp16 scale per group (the `int8-g32` scheme, llama.cpp's Q8_0 grid) when the model is loaded, so a decode
step streams about a quarter of their fp32 bytes. Why groups: one scale per output row (the `int8` scheme) moved
the default model's logits by up to 0.8-0.96 and its greedy outputs matched fp32's on 59% of the tokens (8 GSM8K
prompts, 64 tokens); groups of 32 match on all of them, at the same decode speed (benchmarks/quant.py).

At batch 1 a decode step is memory-bound: every weight crosses memory once per token. The quantized layers
(posttrain.quant.linear.QuantizedLinear) pick their kernel per call: the engine's decode rows run posttrain's C
kernel (fp32 activations, int8 codes widened in registers, each group's sum scaled at its end), larger inputs
(prefill) dequantize and take the fp32 matmul. With `int8` lm_head and the embeddings stay in float, as GPTQ, AWQ
and bitsandbytes leave them (SmolLM2's lm_head is its tied embedding: quantizing it adds a copy). `q8_0` rounds
the LM head the same way too, as llama.cpp's Q8_0 does its output matrix: at batch 1 the fp32 head is a fifth of
the model's bytes (SmolLM2: 113 MB of 538), half of what is left once the decoder is int8. A tied head gets its own
int8 copy (28 MB); the embedding stays fp32 for the lookups. Its error lands on every logit: measured on the
default model, batch-1 decode 40.4 -> 47.5 tokens/s and greedy tokens equal to fp32's 87% -> 79% (docs/quant.md).

Inference only: a trainer's live module keeps its float weights (an optimizer cannot step int8 codes), so the
engine refuses `quant` on a module it did not load.
"""

from __future__ import annotations

import torch

from posttrain.errors import PosttrainError
from posttrain.quant.linear import QuantizedLinear, quantize_model

# What `--quant` accepts -> the scheme its layers get (posttrain.quant.schemes).
INFERENCE_SCHEMES = {"int8": "int8-g32", "q8_0": "q8_0"}
QUANTIZES_LM_HEAD = {"q8_0"}  # and the LM head too (llama.cpp's Q8_0 files round their output matrix)


def check_inference_quant(quant: str | None) -> str | None:
    """`quant` itself when it is None or a name the inference commands take; else one clear error."""
    if quant is not None and quant not in INFERENCE_SCHEMES:
        raise PosttrainError(f"quant={quant!r}: the inference commands take {', '.join(INFERENCE_SCHEMES)} (or none)")
    return quant


def quantize_for_inference(model: torch.nn.Module, quant: str | None) -> torch.nn.Module:
    """The model with its decoder linears (and with q8_0 its LM head) quantized by `quant` (in place; frozen), or
    unchanged for None."""
    if check_inference_quant(quant) is None:
        return model
    scheme = INFERENCE_SCHEMES[quant]
    model = quantize_model(model, scheme)
    head = getattr(model, "lm_head", None)
    if quant in QUANTIZES_LM_HEAD and type(head) is torch.nn.Linear:
        model.lm_head = QuantizedLinear.from_linear(head, scheme, source="lm_head")
    model.requires_grad_(False)
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights as held: parameters once each (a tied lm_head once) plus quantized
    layers' codes, scales and biases."""
    params = {id(p): p for p in model.parameters()}.values()
    quantized = [b for m in model.modules() if isinstance(m, QuantizedLinear) for b in m.buffers(recurse=False)]
    return sum(t.numel() * t.element_size() for t in (*params, *quantized))
