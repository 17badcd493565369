from __future__ import annotations

import math

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from posttrain.cli import main
from posttrain.config import parse_cli_config
from posttrain.errors import ConfigError
from posttrain.models.checkpoint_io import save_hf_dir
from posttrain.models.transformer import Transformer
from posttrain.tokenizer import Tokenizer
from posttrain.trainers.distill import DistillConfig, VocabMismatchError, check_shared_vocab, train_distill
from tests.data.tiny import (
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    save_tiny_model_dir,
    tiny_model,
    tiny_model_config,
    tiny_tokenizer,
)
from tests.trainers.pref_helpers import config, read_metrics, setup_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    student, data = setup_dir(root, seed=0)
    teacher = save_tiny_model_dir(root / "teacher", seed=1)
    return student, teacher, data


def test_off_policy_forward_kl_falls(tiny, tmp_path):
    student, teacher, data = tiny
    cfg = config(
        DistillConfig,
        student,
        data,
        tmp_path / "run",
        f"teacher.name_or_path={teacher}",
        "train.max_steps=8",
        "train.batch_size=6",
        "data.eval_fraction=0.25",
        "optim.lr=3e-3",
        "optim.schedule=constant",
    )
    records = read_metrics(train_distill(cfg))
    before, steps = records[0], [r for r in records if "loss" in r]
    assert before["step"] == 0
    assert steps[-1]["loss"] < 0.7 * steps[0]["loss"]
    assert records[-1]["eval_loss"] < before["eval_loss"]  # held-out completions, never trained on


@pytest.mark.parametrize("loss", ["reverse_kl", "jsd"])
def test_on_policy_samples_from_the_live_student(tiny, tmp_path, loss):
    student, teacher, data = tiny
    cfg = config(
        DistillConfig,
        student,
        data,
        tmp_path / loss,
        f"teacher.name_or_path={teacher}",
        "mode=on_policy",
        f"loss={loss}",
        "beta=0.3",
        "max_new_tokens=6",
        "train.max_steps=4",
        "train.batch_size=4",
        "optim.lr=3e-3",
        "data.eval_fraction=0.25",
        "optim.schedule=constant",
    )
    records = [r for r in read_metrics(train_distill(cfg)) if "loss" in r]
    assert len(records) == 4 and all(math.isfinite(r["loss"]) and r["loss_tokens"] > 0 for r in records)
    assert (tmp_path / loss / "final" / "model.safetensors").is_file()


def test_vocab_mismatch_fails_clearly(tiny, tmp_path):
    student, _, data = tiny
    wide = save_hf_dir(
        Transformer(tiny_model_config(vocab_size=VOCAB_SIZE + 8)), tmp_path / "wide", tokenizer=tiny_tokenizer()
    )
    cfg = config(DistillConfig, student, data, tmp_path / "run", f"teacher.name_or_path={wide}", "train.max_steps=1")
    with pytest.raises(VocabMismatchError, match="328 logits per token, student .* has 320"):
        train_distill(cfg)

    backend = BackendTokenizer(models.BPE())  # same size and specials, different merges
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        ["zebra quartz jumps over lazy vexing fox " * 3] * 20,
        trainers.BpeTrainer(
            vocab_size=VOCAB_SIZE,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    other = Tokenizer(backend, eos_token="<|im_end|>")
    model = tiny_model()
    if other.vocab_size != VOCAB_SIZE:
        match = "tokens, student's"
    else:
        match = "tokenizers differ at id"
    with pytest.raises(VocabMismatchError, match=match):
        check_shared_vocab(model, tiny_tokenizer(), model, other, "student", "teacher")


def test_cli_and_bad_config(tiny, tmp_path):
    student, teacher, data = tiny
    assert (
        main(
            [
                "distill",
                f"model.name_or_path={student}",
                f"teacher.name_or_path={teacher}",
                f"data.path={data}",
                f"out={tmp_path / 'cli'}",
                "train.max_steps=1",
                "train.progress=false",
                "--loss",
                "jsd",
            ]
        )
        == 0
    )
    with pytest.raises(ConfigError, match=r"loss: unknown loss 'kl' \(choose from forward_kl, reverse_kl, jsd\)"):
        parse_cli_config(DistillConfig, [f"data.path={data}", f"teacher.name_or_path={teacher}", "loss=kl"])
    with pytest.raises(ConfigError, match="teacher model is required"):
        parse_cli_config(DistillConfig, [f"data.path={data}"])
