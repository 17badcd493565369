"""The embedded default model (SmolLM2-135M) with LoRA, both directions against peft on the same weights."""

from __future__ import annotations

import pytest
import torch

from posttrain.models.checkpoint_io import load_hf_dir
from posttrain.peft import LoraConfig, apply_lora, load_peft_adapter, save_peft_adapter, set_adapter
from tests.peft.lora_helpers import hf_model, random_ids, randomize_adapters, randomize_peft

peft = pytest.importorskip("peft", reason="peft is the oracle for the adapter format")
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def test_round_trip_both_ways(default_model_dir, tmp_path):
    ours = load_hf_dir(default_model_dir).eval()
    ids = random_ids((1, 16), vocab=ours.config.vocab_size)
    # ours -> peft
    apply_lora(ours, LoraConfig(r=8, alpha=16, target_modules="all-linear"), adapter_name="ours")
    randomize_adapters(ours, "ours", std=0.02)
    save_peft_adapter(ours, tmp_path / "ours", default_model_dir)
    reference = peft.PeftModel.from_pretrained(hf_model(default_model_dir), tmp_path / "ours").eval()
    with torch.no_grad():
        assert (ours(ids) - reference(ids).logits).abs().max().item() <= 1e-5
    # peft -> ours: a second adapter made by peft on the same transformers model
    reference.add_adapter(
        "theirs",
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], task_type="CAUSAL_LM"),
    )
    randomize_peft(reference, seed=1, adapter="theirs")
    reference.set_adapter("theirs")
    reference.save_pretrained(tmp_path / "peft", selected_adapters=["theirs"])
    load_peft_adapter(ours, tmp_path / "peft" / "theirs", adapter_name="theirs")
    with torch.no_grad():
        theirs = reference(ids).logits
        assert (ours(ids) - theirs).abs().max().item() <= 1e-5
        set_adapter(ours, "ours")
        assert (ours(ids) - theirs).abs().max().item() > 1e-3  # the two adapters differ
