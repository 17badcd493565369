"""DPO / KTO's precomputed reference table is taken under the autocast the policy's forwards run under (bf16 with
`model.dtype: auto` on a CPU with fast bf16, forced here), so before the first step policy and reference are one
computation; on a CPU without fast bf16 both stay fp32."""

from __future__ import annotations

import pytest
import torch

from posttrain.hardware import FEATURES_ENV
from posttrain.trainers.preference import dpo, reference
from posttrain.trainers.preference.dpo import DPOConfig, train_dpo
from tests.trainers.pref_helpers import config, setup_dir

AVX2 = "avx avx2 fma"
ZEN5 = "avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return setup_dir(tmp_path_factory.mktemp("dpo_autocast"))


def _autocast() -> torch.dtype | None:
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


def _record_autocast(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Wrap the reference's precompute (reference.frozen_pair_logps; KTO's unpaired rows: frozen_logps) and the
    policy's forward (dpo.pair_logps) to record the CPU autocast dtype each call runs under."""
    seen: dict[str, list] = {"reference": [], "policy": []}
    spied = ((reference, "frozen_pair_logps", "reference"), (reference, "frozen_logps", "reference"))
    for module, name, key in (*spied, (dpo, "pair_logps", "policy")):
        original = getattr(module, name)

        def spy(*args, _original=original, _key=key, **kwargs):
            seen[_key].append(_autocast())
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return seen


@pytest.mark.parametrize("features, expected", [(ZEN5, torch.bfloat16), (AVX2, None)])
@pytest.mark.parametrize("loss", ["sigmoid", "kto"])
def test_the_precomputed_reference_runs_under_the_policys_autocast(
    tiny, tmp_path, monkeypatch, features, expected, loss
):
    monkeypatch.setenv(FEATURES_ENV, features)
    seen = _record_autocast(monkeypatch)
    model_dir, data = tiny
    cfg = config(
        DPOConfig, model_dir, data, tmp_path / "run", "train.max_steps=1", "train.batch_size=4", f"loss={loss}"
    )
    train_dpo(cfg)
    assert seen["reference"] and seen["policy"]
    assert set(seen["reference"]) == {expected}
    assert set(seen["policy"]) == {expected}  # one process too: the policy's passes go through the Parallel
