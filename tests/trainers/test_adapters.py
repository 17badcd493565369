"""LoRA, QLoRA and QAT in every trainer (posttrain.trainers.adapters), on tiny random models.

Each trainer's model is caught right after `prepare_trainable` (a spy on the module function every trainer
goes through), so a test can compare the frozen state before and after a short run bit for bit.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from posttrain.cli import main as cli_main
from posttrain.config import load_config
from posttrain.errors import ConfigError, PosttrainError
from posttrain.models.hub import load_model
from posttrain.peft import LoRALinear, load_peft_adapter, lora_state_dict, merge_lora
from posttrain.quant import FakeQuantLinear, QuantizedLinear, is_quantized_dir, set_compute
from posttrain.rewards.model_reward import load_score_head
from posttrain.trainers import adapters, reward_model
from posttrain.trainers.distill import DistillConfig, train_distill
from posttrain.trainers.preference import reference
from posttrain.trainers.preference.dpo import DPOConfig, train_dpo
from posttrain.trainers.reward_model import RMConfig, train_reward_model
from posttrain.trainers.rl.config import GRPOConfig, PPOConfig
from posttrain.trainers.sft import SFTConfig, start_sft, train_sft
from tests.data.tiny import save_tiny_model_dir
from tests.trainers.pref_helpers import config, read_metrics, setup_dir

LORA = ("lora.r=4", "lora.alpha=8")
FAST = ("train.max_steps=2", "train.batch_size=4", "optim.lr=1e-2", "optim.schedule=constant")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(student / policy model dir, pairs.jsonl, teacher model dir)."""
    root = tmp_path_factory.mktemp("adapters")
    model_dir, data = setup_dir(root, seed=0)
    return model_dir, data, save_tiny_model_dir(root / "teacher", seed=1)


@pytest.fixture
def prepared(monkeypatch) -> list[tuple[torch.nn.Module, dict[str, torch.Tensor]]]:
    """(model, its state right after prepare_trainable) for every model a trainer prepares."""
    seen = []
    original = adapters.prepare_trainable

    def spy(model, **options):
        out = original(model, **options)
        seen.append((out, {k: v.detach().clone() for k, v in out.state_dict().items()}))
        return out

    monkeypatch.setattr(adapters, "prepare_trainable", spy)
    return seen


def assert_only_adapters_trained(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    frozen = [k for k in before if ".lora_" not in k]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen), "a base tensor moved"
    lora_B = [k for k in before if ".lora_B." in k]
    assert lora_B and all(not torch.equal(before[k], after[k]) for k in lora_B), "an adapter did not train"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)


def assert_adapter_loads_back(final: Path, model: torch.nn.Module, base_dir: Path, same_logits: bool = True) -> None:
    """final/ is a PEFT adapter whose tensors, loaded onto a fresh float base, are the trained ones."""
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    assert not (final / "model.safetensors").exists(), "a LoRA run saves the adapter only"
    fresh, tokenizer = load_model(base_dir, device="cpu")
    load_peft_adapter(fresh, final)
    ours, theirs = lora_state_dict(model), lora_state_dict(fresh)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    if same_logits:
        ids = torch.tensor([tokenizer.encode("What is 2 plus 3? The answer is 5.")])
        with torch.no_grad():
            torch.testing.assert_close(fresh.eval()(ids), model.eval()(ids), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- LoRA in every trainer


def test_sft_lora_trains_adapters_only_and_saves_peft_files(tiny, tmp_path, prepared):
    model_dir, data, _ = tiny
    cfg = config(
        SFTConfig, model_dir, data, tmp_path / "run", *LORA, *FAST, "train.save_every=1", "train.keep_checkpoints=1"
    )
    run_dir = train_sft(cfg)
    ((model, before),) = prepared
    assert_only_adapters_trained(model, before)
    assert_adapter_loads_back(run_dir / "final", model, model_dir)
    assert (run_dir / "final" / "tokenizer.json").is_file()
    assert (run_dir / "checkpoints" / "step-1" / "adapter_model.safetensors").is_file()


def test_dpo_lora_reference_is_the_base_with_adapters_off(tiny, tmp_path, prepared, monkeypatch):
    model_dir, data, _ = tiny
    # No frozen copy of the policy: the live reference must be the policy module itself.
    monkeypatch.setattr(reference, "copy", types.SimpleNamespace(deepcopy=lambda m: pytest.fail("copied the policy")))
    runs = {}
    for ref in ("precompute", "live"):
        cfg = config(
            DPOConfig, model_dir, data, tmp_path / ref, *LORA, *FAST, f"reference={ref}", "optim.warmup_ratio=0"
        )
        runs[ref] = [r for r in read_metrics(train_dpo(cfg)) if "loss" in r]
    assert runs["live"][0]["loss"] == pytest.approx(0.6931472, abs=1e-5)  # policy == reference at step 1
    for a, b in zip(runs["precompute"], runs["live"]):  # step 2 too: the live reference stays the base
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
    model, before = prepared[-1]
    assert_only_adapters_trained(model, before)
    assert_adapter_loads_back(tmp_path / "live" / "final", model, model_dir)


def test_reward_model_lora_trains_the_head_beside_the_adapters(tiny, tmp_path, prepared, monkeypatch):
    model_dir, data, _ = tiny
    heads = []
    original = reward_model.new_score_head

    def record_head(*args, **kwargs):
        head = original(*args, **kwargs)
        heads.append((head, head.weight.detach().clone()))
        return head

    monkeypatch.setattr(reward_model, "new_score_head", record_head)
    run_dir = train_reward_model(config(RMConfig, model_dir, data, tmp_path / "rm", *LORA, *FAST))
    ((trunk, before),) = prepared
    assert_only_adapters_trained(trunk, before)
    assert_adapter_loads_back(run_dir / "final", trunk, model_dir)
    ((head, initial),) = heads
    assert head.weight.requires_grad and not torch.equal(head.weight, initial), "the score head did not train"
    saved = load_score_head(run_dir / "final", trunk.config.hidden_size)
    assert torch.equal(saved.weight, head.weight.detach().float())


@pytest.mark.parametrize("mode", ["off_policy", "on_policy"])
def test_distill_lora_trains_the_student_adapters(tiny, tmp_path, prepared, mode):
    model_dir, data, teacher = tiny
    extra = ("max_new_tokens=4",) if mode == "on_policy" else ()
    cfg = config(
        DistillConfig,
        model_dir,
        data,
        tmp_path / mode,
        *LORA,
        *FAST,
        f"teacher.name_or_path={teacher}",
        f"mode={mode}",
        *extra,
    )
    run_dir = train_distill(cfg)
    ((student, before),) = prepared  # the teacher is never prepared: it is loaded frozen
    assert_only_adapters_trained(student, before)
    assert_adapter_loads_back(run_dir / "final", student, model_dir)


# ----------------------------------------------------------------------------- QLoRA


@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
def test_sft_qlora_trains_adapters_over_a_quantized_base(tiny, tmp_path, prepared, scheme):
    model_dir, data, _ = tiny
    run_dir = train_sft(config(SFTConfig, model_dir, data, tmp_path / scheme, *LORA, *FAST, f"quant={scheme}"))
    ((model, before),) = prepared
    q_proj = model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, LoRALinear) and isinstance(q_proj.base_layer, QuantizedLinear)
    assert q_proj.base_layer.scheme.name == scheme
    assert_only_adapters_trained(model, before)  # the int codes and scales are bit-identical too
    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    # The adapter is what is saved, and it loads onto the float base (what `posttrain lora-merge` does).
    assert_adapter_loads_back(run_dir / "final", model, model_dir, same_logits=False)
    with pytest.raises(PosttrainError, match="cannot merge into a torch.u?int8 \\(quantized\\) base weight"):
        merge_lora(model)


def test_dpo_qlora_trains_with_an_int4_base(tiny, tmp_path, prepared):
    model_dir, data, _ = tiny
    cfg = config(
        DPOConfig,
        model_dir,
        data,
        tmp_path / "dpo",
        *LORA,
        *FAST,
        "quant=int4-g32",
        "reference=live",
        "optim.warmup_ratio=0",
    )
    records = [r for r in read_metrics(train_dpo(cfg)) if "loss" in r]
    assert records[0]["loss"] == pytest.approx(0.6931472, abs=1e-5)  # the reference is the quantized base
    ((model, before),) = prepared
    assert isinstance(model.layers[1].mlp.down_proj.base_layer, QuantizedLinear)
    assert_only_adapters_trained(model, before)
    assert_adapter_loads_back(tmp_path / "dpo" / "final", model, model_dir, same_logits=False)


def test_grpo_qlora_step_with_the_quantized_base_as_reference(tmp_path):
    from posttrain.trainers.rl import rl_step, setup_run
    from tests.trainers.rl_helpers import rl_overrides, tiny_model, tokenizer

    tok = tokenizer()
    cfg = load_config(
        GRPOConfig,
        None,
        rl_overrides(
            tmp_path,
            "grpo",
            *LORA,
            "quant=int8",
            "kl.beta=0.1",
            "optim.lr=1e-2",
        ),
    )
    run = setup_run(cfg, "grpo", model=tiny_model(tok), tokenizer=tok)
    assert run.reference is None and isinstance(run.model.layers[0].self_attn.v_proj.base_layer, QuantizedLinear)
    codes = run.model.layers[0].self_attn.v_proj.base_layer.qweight.clone()
    metrics = rl_step(run, 1)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # the first update runs at the (quantized) base
    assert torch.equal(codes, run.model.layers[0].self_attn.v_proj.base_layer.qweight)
    assert any(v.abs().sum() > 0 for k, v in lora_state_dict(run.model).items() if "lora_B" in k)


# ----------------------------------------------------------------------------- QAT


def test_sft_qat_exports_a_quantized_dir_close_to_the_fake_quant_model(tiny, tmp_path):
    model_dir, data, _ = tiny
    cfg = config(SFTConfig, model_dir, data, tmp_path / "qat", *FAST, "qat=int8", "optim.lr=1e-3")
    session = start_sft(cfg)
    initial = session.model.layers[0].mlp.up_proj.weight.detach().clone()
    for step in range(session.max_steps):
        session.step(step)
    model = session.model.eval()
    assert isinstance(model.layers[0].mlp.up_proj, FakeQuantLinear)
    assert not torch.equal(initial, model.layers[0].mlp.up_proj.weight), "QAT trains the float weights"
    ids = torch.tensor([session.tokenizer.encode("What is 2 plus 3? The answer is 5.")])
    with torch.no_grad():
        fake = model(ids)
    final = adapters.save_final_dir(model, session.tokenizer, session.run_dir, base_model=str(model_dir))
    assert is_quantized_dir(final)
    loaded, _ = load_model(final, device="cpu")
    assert isinstance(loaded.layers[0].mlp.up_proj, QuantizedLinear)
    with torch.no_grad():
        # Same integer codes and scales as the fake quantization: equal up to fp32 rounding on the exact
        # (reference) kernel, and up to the bf16 activations of the fast CPU kernels.
        torch.testing.assert_close(set_compute(loaded, "reference")(ids), fake, rtol=1e-4, atol=1e-4)
        fast = set_compute(loaded, "auto")(ids)
    assert (fast - fake).abs().max() < 0.05 * fake.abs().max()


def test_train_sft_qat_final_loads_in_eval_ppl(tiny, tmp_path, capsys):
    model_dir, data, _ = tiny
    run_dir = train_sft(
        config(SFTConfig, model_dir, data, tmp_path / "qat", *FAST, "qat=int4-g32", "train.save_every=1")
    )
    checkpoint = run_dir / "checkpoints" / "step-1"  # mid-run saves keep the float weights
    assert (checkpoint / "model.safetensors").is_file() and not is_quantized_dir(checkpoint)
    final = run_dir / "final"
    assert is_quantized_dir(final) and (final / "tokenizer.json").is_file()
    assert (
        cli_main(["eval", "ppl", "--model", str(final), "--data", str(data), "--column", "chosen", "--device", "cpu"])
        == 0
    )
    assert "perplexity" in capsys.readouterr().out


# ----------------------------------------------------------------------------- bad combinations


@pytest.mark.parametrize("cls", [SFTConfig, DPOConfig, RMConfig, DistillConfig, GRPOConfig, PPOConfig])
def test_quant_without_lora_is_refused_naming_the_key(cls, tiny):
    _, data, teacher = tiny
    extra = [] if cls in (GRPOConfig, PPOConfig) else [f"data.path={data}"]  # RL's default task needs no file
    if cls is DistillConfig:
        extra.append(f"teacher.name_or_path={teacher}")
    with pytest.raises(ConfigError, match=r"quant='int8' needs a lora: section"):
        load_config(cls, None, [*extra, "quant=int8"])
    with pytest.raises(ConfigError, match=r"quant: unknown quantization scheme 'int3' \(choose from int8"):
        load_config(cls, None, [*extra, "quant=int3", *LORA])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["qat=int8", *LORA], "qat and lora cannot be combined"),
        (["qat=int8", "quant=int8", *LORA], "qat and quant cannot be combined"),
        (["qat=int5"], r"qat: unknown quantization scheme 'int5'"),
    ],
)
def test_bad_qat_combinations_fail_on_load(tiny, overrides, match):
    _, data, _ = tiny
    with pytest.raises(ConfigError, match=match):
        load_config(SFTConfig, None, [f"data.path={data}", *overrides])


def test_qat_is_an_sft_option_only(tiny):
    _, data, _ = tiny
    with pytest.raises(ConfigError, match="unknown key 'qat'"):
        load_config(DPOConfig, None, [f"data.path={data}", "qat=int8"])


def test_a_config_built_in_python_fails_before_the_model_loads(tiny, tmp_path, monkeypatch):
    model_dir, data, _ = tiny
    monkeypatch.setattr(adapters, "load_model", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    cfg = config(SFTConfig, model_dir, data, tmp_path / "bad")
    cfg.quant = "int8"  # set after load_config, so only the trainer's own check can catch it
    with pytest.raises(ConfigError, match="quant='int8' needs a lora: section"):
        train_sft(cfg)
    assert not (tmp_path / "bad").exists()
