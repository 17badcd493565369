"""Sliding windows per layer, mixtures of experts and latent attention against transformers on identical
weights and inputs (fp32, max abs diff <= 1e-4): the dense-family parity tests, run on these families,
plus the router's auxiliary loss and the saved checkpoint read back by transformers."""

from __future__ import annotations

import pytest
import torch

from posttrain.models.checkpoint_io import load_hf_dir, save_hf_dir
from posttrain.models.config import ModelConfig
from posttrain.models.moe import router_loss_and_metrics
from tests.models.sparse_oracle import MOE_FAMILIES, SPARSE_FAMILIES, save_sparse_hf_model
from tests.models.test_parity import (  # noqa: F401  (collected here, on this module's `pair`)
    TOL,
    test_hidden_states_then_logits_equals_forward,
    test_logits_match,
    test_packed_batch_equals_per_sequence,
    test_padded_batch_matches_each_sequence,
    test_parameter_count_matches_transformers,
)


@pytest.fixture(scope="module", params=sorted(SPARSE_FAMILIES))
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_sparse_hf_model(request.param, directory)
    return request.param, hf, load_hf_dir(directory).eval()


def test_saved_checkpoint_loads_in_transformers(pair, tmp_path):
    """to_hf writes every family setting back: transformers rebuilds the same model from our save."""
    import transformers

    family, hf, ours = pair
    save_hf_dir(ours, tmp_path / "saved")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    assert type(again) is type(hf)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (again(ids).logits - ours(ids)).abs().max().item() <= TOL
    assert ModelConfig.from_hf(ours.config.to_hf()) == ours.config


@pytest.mark.parametrize("padded", [False, True])
def test_router_aux_loss_matches_transformers(pair, padded):
    family, hf, ours = pair
    if family not in MOE_FAMILIES or family.startswith("deepseek"):  # DeepSeek trains without the Switch loss
        pytest.skip("no Switch-style auxiliary loss in this family")
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :6] = 0  # left padding in row 1
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        expected = hf(ids, attention_mask=mask, position_ids=positions, output_router_logits=True).aux_loss
        ours(ids, attention_mask=mask)
        term, metrics = router_loss_and_metrics(ours, mask if padded else None)
    coef = ours.config.moe.router_aux_loss_coef
    assert abs(metrics["router/aux_loss"] - float(expected)) <= 1e-5
    assert abs(float(term) - coef * float(expected)) <= 1e-7
    assert metrics["router/load_min"] <= 1.0 <= metrics["router/load_max"]
    assert router_loss_and_metrics(ours) == (None, {})  # consumed: each forward counts once
