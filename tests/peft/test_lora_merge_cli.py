"""`posttrain lora-merge`: a peft adapter merged into its base, saved as a plain HF directory that transformers
loads with the logits of peft's own merge (and of the unmerged peft model, up to the rounding of merging)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from posttrain.cli import main
from tests.numeric import assert_reordered
from tests.peft.lora_helpers import hf_model, random_ids, randomize_peft

peft = pytest.importorskip("peft", reason="peft is the oracle for the adapter format")
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def peft_adapter(tiny_dirs, tmp_path_factory):
    reference = peft.get_peft_model(
        hf_model(tiny_dirs["qwen2"]),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_rslora=True, task_type="CAUSAL_LM"),
    )
    randomize_peft(reference)
    out = tmp_path_factory.mktemp("adapter")
    reference.save_pretrained(out)
    return out, reference.eval()


def test_merged_directory_loads_in_transformers_with_peft_logits(tiny_dirs, peft_adapter, tmp_path, capsys):
    adapter, reference = peft_adapter
    out = tmp_path / "merged"
    assert main(["lora-merge", "--model", str(tiny_dirs["qwen2"]), "--adapter", str(adapter), "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert not any("lora" in key for key in load_file(out / "model.safetensors"))
    merged = hf_model(out)
    ids = random_ids((2, 11))
    peft_merged = peft.PeftModel.from_pretrained(hf_model(tiny_dirs["qwen2"]), adapter).merge_and_unload()
    with torch.no_grad():
        # W + s B A against W x + s B (A x), and our merge against peft's: the same logits up to the sums' order.
        assert_reordered(merged(ids).logits, reference(ids).logits)
        assert_reordered(merged(ids).logits, peft_merged(ids).logits)


def test_refusals_are_one_line(tiny_dirs, peft_adapter, tmp_path, capsys):
    adapter, _ = peft_adapter
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    argv = ["lora-merge", "--model", str(tiny_dirs["qwen2"]), "--adapter", str(adapter), "--out", str(out)]
    assert main(argv) == 2
    assert "already exists and is not empty (use --force to replace it)" in capsys.readouterr().err
    argv[4] = str(tmp_path / "no-adapter")
    assert main(argv + ["--force"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no-adapter: no such adapter directory" in err and err.count("\n") == 1
    assert (out / "keep.txt").is_file()
