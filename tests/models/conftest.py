"""What several model tests compare against, built once per session."""

from __future__ import annotations

import pytest
import torch

from posttrain.models.hub import DEFAULT_MODEL, packaged_gguf_path


@pytest.fixture(scope="session")
def hf_from_gguf() -> torch.nn.Module:
    """transformers' own reading of the embedded default model's GGUF (fp32, eval mode): the oracle of the GGUF
    reader and of the default model's logits. Its GGUF loader takes ~30 s on 2 cores, so the tests share one."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    gguf = packaged_gguf_path(DEFAULT_MODEL)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()
