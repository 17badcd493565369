"""QAT: fake-quant forward equals quantize-dequantize, straight-through gradients, convert == quantize_model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from posttrain.errors import PosttrainError
from posttrain.quant import FakeQuantLinear, QuantizedLinear, convert_qat, fake_quantize, prepare_qat, quantize_model
from posttrain.quant.codec import fake_quantize_activations
from tests.quant.tiny import tiny_model


@pytest.mark.parametrize("name", ["int8", "int4-g32-asym", "w8a8", "q8_0"])
def test_forward_is_quantize_dequantize_and_gradient_is_straight_through(name):
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=True)
    fq = FakeQuantLinear(linear, name)
    x = torch.randn(3, 4, 64, requires_grad=True)
    y = fq(x)
    w_q = fake_quantize(linear.weight.detach(), fq.scheme)
    x_q = fake_quantize_activations(x.detach(), fq.scheme) if fq.scheme.activation_bits else x.detach()
    assert torch.equal(y, F.linear(x_q, w_q, linear.bias))
    grad_out = torch.randn_like(y)
    (y * grad_out).sum().backward()
    # Straight-through: the gradients of an nn.Linear that holds the rounded weight, applied to the float weight.
    assert torch.allclose(linear.weight.grad, grad_out.reshape(-1, 32).T @ x_q.reshape(-1, 64), atol=1e-5)
    assert torch.allclose(linear.bias.grad, grad_out.sum((0, 1)), atol=1e-5)
    assert torch.allclose(x.grad, grad_out @ w_q, atol=1e-5)


def test_prepare_qat_keeps_the_parameters_and_trains(model):
    params = {n: p for n, p in model.named_parameters()}
    prepare_qat(model, "int4-g32")
    assert {n: p for n, p in model.named_parameters()} == params  # same names, same Parameter objects
    assert isinstance(model.layers[1].mlp.down_proj, FakeQuantLinear) and type(model.lm_head) is nn.Linear
    assert model.state_dict().keys() == tiny_model().state_dict().keys()  # saves as a plain float checkpoint
    ids = torch.randint(0, 128, (4, 16))
    losses = []
    for _ in range(5):  # plain SGD by hand (torch.optim's first use imports torch._dynamo: seconds)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 128), ids[:, 1:].reshape(-1))
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(p.grad, alpha=0.05)
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", ["int8-asym", "int4-g64", "w8a8"])
def test_convert_qat_equals_quantize_model_of_the_trained_weights(model, name):
    prepare_qat(model, name)
    with torch.no_grad():  # "training" moved the weights
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    trained = copy.deepcopy(model)
    for n, m in list(trained.named_modules()):  # the same weights as plain nn.Linear layers
        if isinstance(m, FakeQuantLinear):
            plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            plain.weight, plain.bias = m.weight, m.bias
            parent, _, child = n.rpartition(".")
            setattr(trained.get_submodule(parent), child, plain)
    ids = torch.randint(0, 128, (2, 10))
    with torch.no_grad():
        fake = model(ids)
    convert_qat(model)
    quantize_model(trained, name)
    ours, theirs = model.state_dict(), trained.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert model.config.extra["quantization_config"]["scheme"] == name
    with torch.no_grad():  # the fake-quant model predicted what the converted one computes (up to bf16 kernels)
        converted = model(ids)
    assert ((converted - fake).norm() / fake.norm()).item() < 0.02
    assert sum(isinstance(m, QuantizedLinear) for m in model.modules()) == 14


def test_qat_errors(model):
    with pytest.raises(PosttrainError, match="no FakeQuantLinear layers"):
        convert_qat(model)
    with pytest.raises(PosttrainError, match="unknown quantization scheme 'int2'"):
        prepare_qat(model, "int2")
    quantize_model(model, "int8")
    with pytest.raises(PosttrainError, match="layers.0.self_attn.q_proj is a QuantizedLinear, not nn.Linear"):
        prepare_qat(model, "int8")
