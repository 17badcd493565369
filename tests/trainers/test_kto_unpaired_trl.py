"""One KTO batch from an unpaired file against TRL 1.16's own pipeline on the same rows and weights.

TRL side: `KTOTrainer._prepare_dataset` (tokenization, EOS, the KL completions rotated within a batch of
`per_device_train_batch_size`), `DataCollatorForUnpairedPreference`, then `KTOTrainer._compute_loss`, on a
trainer made with object.__new__ (as in tests/algos/test_trl_preference.py). Its "model" is our module
behind TRL's fused-head interface, so both sides score with the same weights: the reference is a noisy
copy of the policy, so rewards and the KL point z0 are away from 0 (what a trained run looks like).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from posttrain.models.hub import load_model
from posttrain.models.transformer import Transformer
from posttrain.trainers.preference.dpo import DPOConfig
from posttrain.trainers.preference.kto import KTORun
from posttrain.trainers.preference.unpaired import load_unpaired
from tests.algos.trl_stubs import FakeAccelerator, new_metrics
from tests.trainers.pref_helpers import config, setup_dir, write_jsonl
from tests.trainers.test_kto_unpaired import unpaired_rows

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

BATCH = 4


class FusedHead:
    """Our module as TRL calls a model with `fused_lm_head=True`: per-token logps of the shifted labels, 0 at -100."""

    training = True

    def __init__(self, model: Transformer) -> None:
        self.model = model

    @torch.no_grad()
    def __call__(
        self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor, **_: object
    ) -> SimpleNamespace:
        logp = torch.log_softmax(
            self.model(input_ids, attention_mask=attention_mask)[:, :-1].float(), -1
        )  # (B, T-1, V)
        target = labels[:, 1:]  # (B, T-1)
        picked = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
        log_probs = torch.where(target != -100, picked, torch.zeros(()))
        zeros = torch.zeros_like(log_probs)
        return SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros)


def _completion_logps(model: FusedHead, batch: dict, prefix: str = "") -> torch.Tensor:
    ids = batch[f"{prefix}input_ids"]
    labels = ids.masked_fill(batch[f"{prefix}completion_mask"] == 0, -100)
    return model(input_ids=ids, attention_mask=batch[f"{prefix}attention_mask"], labels=labels).log_probs.sum(-1)


def test_one_unpaired_batch_matches_trl_kto_trainer(tmp_path):
    from trl import KTOTrainer
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    model_dir, _ = setup_dir(tmp_path)
    rows = unpaired_rows()
    data_path = write_jsonl(tmp_path / "unpaired.jsonl", rows)
    cfg: DPOConfig = config(
        DPOConfig,
        model_dir,
        data_path,
        tmp_path / "unused",
        "loss=kto",
        f"train.batch_size={BATCH}",
        "beta=0.3",
        "undesirable_weight=1.4",
    )
    model, tok = load_model(model_dir)
    data = load_unpaired(cfg.data, tok, seed=0, batch_size=BATCH)
    batch = next(b for b in data.train.batches if 0 < sum(rows[i]["label"] for i in b) < BATCH)  # both labels
    initial = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    run = KTORun(cfg, model, data, tok.pad_token_id)  # precomputes the reference: the noisy weights
    reference = FusedHead(copy.deepcopy(model))
    model.load_state_dict(initial)  # the policy: the noise-free weights, which score these sequences higher on average
    loss, sums = run._forward("train", batch, grad=False)

    trainer = object.__new__(KTOTrainer)
    trainer.calculate_KL, trainer._tokenizer = True, transformers.AutoTokenizer.from_pretrained(model_dir)
    trainer.model, trainer.accelerator = SimpleNamespace(training=True), FakeAccelerator()
    trainer.precompute_ref_logps, trainer.loss_type, trainer.aux_loss_enabled = True, "kto", False
    trainer.beta, trainer.desirable_weight, trainer.undesirable_weight = 0.3, 1.0, 1.4
    trainer._metrics, trainer._total_train_tokens, trainer._tp_size = new_metrics(), 0, 1
    args = SimpleNamespace(dataset_num_proc=None, per_device_train_batch_size=BATCH, max_length=None)
    prepared = trainer._prepare_dataset(
        datasets.Dataset.from_list([rows[i] for i in batch]), trainer._tokenizer, args, "eval"
    )
    for k, i in enumerate(batch):  # TRL's KL sequence k is ours: same prompt, same mismatched completion
        assert prepared[k]["prompt_ids"] + prepared[k]["KL_completion_ids"] == data.train.kl[i].input_ids
    inputs = DataCollatorForUnpairedPreference(pad_token_id=tok.pad_token_id)(
        [{key: ex[key] for key in ("prompt_ids", "completion_ids", "KL_completion_ids", "label")} for ex in prepared]
    )
    inputs["ref_logps"], inputs["ref_KL_logps"] = (
        _completion_logps(reference, inputs),
        _completion_logps(reference, inputs, "KL_"),
    )
    trl_loss = trainer._compute_loss(FusedHead(model), inputs, return_outputs=False)

    torch.testing.assert_close(loss.detach(), trl_loss, rtol=1e-4, atol=1e-6)
    logged = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    assert sums["kl"] / sums["rows"] == pytest.approx(logged["kl"], rel=1e-4, abs=1e-6)
    assert logged["kl"] > 0.01  # z0 is not clamped to 0 in this batch
    for side in ("chosen", "rejected"):
        assert sums[f"rewards/{side}"] / sums[f"count/{side}"] == pytest.approx(
            logged[f"rewards/{side}"], rel=1e-4, abs=1e-5
        )
