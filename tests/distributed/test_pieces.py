"""The distributed pieces that need no second process: configuration errors, sharding, activation
checkpointing, and the single-process fall-backs of the collectives."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from posttrain.config import load_config
from posttrain.distributed.config import DistSection
from posttrain.distributed.env import DistContext, all_reduce_count, init_distributed, reduce_metrics
from posttrain.distributed.launch import split_nproc, torchrun_command, without_nproc
from posttrain.distributed.parallel import Parallel
from posttrain.errors import ConfigError
from posttrain.trainers.sft import SFTConfig
from tests.data.tiny import tiny_model
from tests.distributed.launch import ROOT

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def test_fsdp2_without_torchrun_names_the_key_and_the_launch(monkeypatch):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=r"dist.strategy=fsdp2 needs the torchrun environment.*--nproc N"):
        init_distributed("fsdp2", "cpu")


def test_strategy_none_under_a_multi_process_launch_is_refused(monkeypatch):
    for name, value in zip(TORCHRUN_VARS, ("1", "2", "1", "127.0.0.1", "29500")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="dist.strategy=none, but torchrun started 2 processes"):
        init_distributed("none", "cpu")


def test_every_trainer_takes_fsdp2_with_adapters_and_refuses_unknown_strategies():
    from posttrain.trainers.distill import DistillConfig
    from posttrain.trainers.dpo import DPOConfig
    from posttrain.trainers.reward_model import RMConfig
    from posttrain.trainers.rl.config import GRPOConfig, PPOConfig

    qlora = ["dist.strategy=fsdp2", "lora.r=4", "quant=int8"]
    load_config(SFTConfig, overrides=["data.path=x.jsonl", *qlora])
    load_config(SFTConfig, overrides=["data.path=x.jsonl", "dist.strategy=fsdp2", "qat=int8"])
    load_config(DPOConfig, overrides=["data.path=x.jsonl", *qlora])
    load_config(RMConfig, overrides=["data.path=x.jsonl", *qlora])
    load_config(DistillConfig, overrides=["data.path=x.jsonl", "teacher.name_or_path=t", *qlora])
    load_config(GRPOConfig, overrides=[*qlora, "dist.rollout_weights=per_layer"])
    load_config(PPOConfig, overrides=qlora)
    with pytest.raises(Exception, match="dist.strategy"):
        load_config(SFTConfig, overrides=["data.path=x.jsonl", "dist.strategy=zero3"])
    with pytest.raises(Exception, match="reshard_after_forward=false applies to strategy fsdp2 only"):
        load_config(SFTConfig, overrides=["data.path=x.jsonl", "dist.strategy=ddp", "dist.reshard_after_forward=false"])


def test_batch_wide_methods_refuse_data_parallelism_by_name():
    from posttrain.trainers.distill import DistillConfig
    from posttrain.trainers.dpo import DPOConfig
    from posttrain.trainers.rl.config import GRPOConfig

    load_config(
        DistillConfig, overrides=["data.path=x.jsonl", "teacher.name_or_path=t", "mode=on_policy", "dist.strategy=ddp"]
    )  # each rank samples its share of the prompts
    load_config(DPOConfig, overrides=["data.path=x.jsonl", "loss=kto", "dist.strategy=fsdp2"])  # paired KTO runs
    load_config(GRPOConfig, overrides=["algorithm=dapo", "dist.strategy=ddp"])  # refills decided over all ranks
    from posttrain.trainers.rl.config import PPOConfig

    load_config(PPOConfig, overrides=["dist.strategy=fsdp2"])  # the value head is sharded with the root group
    load_config(GRPOConfig, overrides=["algorithm=reinforce_pp", "dist.strategy=ddp"])  # whitened over the ranks


def test_shards_are_strided_and_the_global_batch_must_divide():
    parallel = Parallel(tiny_model(), DistSection(), DistContext(rank=1, world_size=2))
    assert parallel.shard(list(range(6))) == [1, 3, 5]
    parallel.check_divides("train.batch_size", 4)
    with pytest.raises(ConfigError, match=r"train.batch_size=3 is the global batch.*2 processes"):
        parallel.check_divides("train.batch_size", 3)


def test_single_process_collectives_are_identities():
    metrics = {"loss": 1.5, "tokens": 10.0, "grad_norm": 0.3}
    assert reduce_metrics(metrics, {"loss", "tokens"}, torch.device("cpu")) == metrics
    assert all_reduce_count(7, torch.device("cpu")) == 7


def test_activation_checkpointing_keeps_the_gradients():
    ids = torch.randint(0, 300, (2, 12))
    grads = []
    for checkpointing in (False, True):
        model = tiny_model()
        parallel = Parallel(model, DistSection(activation_checkpointing=checkpointing), DistContext())
        loss = parallel.run(lambda m, x: m(x).logsumexp(-1).mean(), ids)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        assert sorted(n for n, _ in model.named_parameters()) == sorted(grads[0])  # names unchanged
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=1e-6)


def test_nproc_is_dropped_from_the_relaunched_command():
    assert without_nproc(["sft", "--nproc", "2", "cfg.yaml", "--nproc=3", "x=1"]) == ["sft", "cfg.yaml", "x=1"]
    command = torchrun_command(2, ["sft", "--nproc", "2", "cfg.yaml"])
    assert command[1:] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "posttrain",
        "sft",
        "cfg.yaml",
    ]


def test_nproc_is_found_among_the_overrides_too():
    assert split_nproc(["cfg.yaml", "--nproc", "2", "x=1"]) == (2, ["cfg.yaml", "x=1"])
    assert split_nproc(["cfg.yaml", "--nproc=4"]) == (4, ["cfg.yaml"])
    assert split_nproc(["cfg.yaml", "x=1"]) == (None, ["cfg.yaml", "x=1"])
    with pytest.raises(ConfigError, match="--nproc needs a number of processes, got 'two'"):
        split_nproc(["--nproc", "two"])


def test_per_layer_rollout_weights_need_fsdp2_and_no_cuda_graphs():
    from posttrain.trainers.rl.config import GRPOConfig

    load_config(GRPOConfig, overrides=["dist.strategy=fsdp2", "dist.rollout_weights=per_layer"])
    for strategy in ("none", "ddp"):
        refused = rf"dist: rollout_weights=per_layer .* fsdp2 only \(strategy is {strategy}"
        with pytest.raises(ConfigError, match=refused):
            load_config(GRPOConfig, overrides=[f"dist.strategy={strategy}", "dist.rollout_weights=per_layer"])
    with pytest.raises(ConfigError, match="dist.rollout_weights: must be one of 'whole', 'per_layer'"):
        load_config(SFTConfig, overrides=["data.path=x.jsonl", "dist.strategy=fsdp2", "dist.rollout_weights=layers"])
    with pytest.raises(ConfigError, match=r"dist.rollout_weights=per_layer .* set rollout.engine.cuda_graphs=false"):
        load_config(
            GRPOConfig,
            overrides=["dist.strategy=fsdp2", "dist.rollout_weights=per_layer", "rollout.engine.cuda_graphs=true"],
        )


def test_rollout_ranks_are_checked_by_key_and_need_the_matching_launch(monkeypatch):
    from posttrain.distributed.rollout_link import join_with_rollout_ranks
    from posttrain.trainers.rl.config import GRPOConfig

    with pytest.raises(ConfigError, match="rollout_ranks must be an integer >= 0"):
        load_config(GRPOConfig, None, ["dist.rollout_ranks=-1"])
    with pytest.raises(ConfigError, match="rollout_ranks=1 trains on one process.*strategy must be none"):
        load_config(GRPOConfig, None, ["dist.rollout_ranks=1", "dist.strategy=ddp"])
    with pytest.raises(ConfigError, match="rollout_timeout_s must be > 0"):
        load_config(GRPOConfig, None, ["dist.rollout_timeout_s=0"])
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=r"dist.rollout_ranks=2 runs rollout processes under torchrun.*--nproc 3"):
        join_with_rollout_ranks(2, 60.0, "cpu")
    for name, value in zip(TORCHRUN_VARS, ("0", "4", "0", "127.0.0.1", "29500")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="leaves 3 trainer processes.*--nproc 2"):
        join_with_rollout_ranks(1, 60.0, "cpu")


def test_a_command_that_ran_to_its_end_leaves_its_process_group(tmp_path):
    """Left to interpreter exit, a gloo group's worker threads may abort a torchrun rank whose run succeeded
    ("terminate called without an active exception"): the CLI destroys the groups when a command returns. After an
    error it leaves them (a posted operation to a rank that is gone would hold up the teardown)."""
    import torch.distributed as dist

    from posttrain.cli import main as cli_main

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert cli_main(["grpo", str(tmp_path / "missing.yaml")]) == 2
        assert dist.is_initialized()
        assert cli_main(["info"]) == 0
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_rank_that_ran_to_its_end_exits_without_the_runtime_teardown(tmp_path):
    """The program (what torchrun starts) exits a rank whose command ran to its end and left its groups with
    os._exit: Python's exit handlers run and the output is flushed, but no interpreter teardown follows (where
    gloo's threads may abort a rank that succeeded)."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import atexit, sys\n"
        "import torch.distributed as dist\n"
        "from posttrain.cli import program\n"
        "class Finalized:\n"
        "    def __del__(self):\n"
        "        print('torn down', flush=True)\n"
        "keep = Finalized()  # a module global: the interpreter's teardown would delete it\n"
        "atexit.register(print, 'exit handler ran')\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "sys.argv = ['posttrain', *sys.argv[1:]]\n"
        "program()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script), "info"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "exit handler ran" in done.stdout and "torn down" not in done.stdout
    # Without a group (an ordinary command line) the program exits the ordinary way.
    script.write_text(script.read_text().replace("dist.init_process_group", "# dist.init_process_group"))
    plain = subprocess.run([sys.executable, str(script), "info"], env=env, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr
    assert "exit handler ran" in plain.stdout and "torn down" in plain.stdout
    failed = subprocess.run(
        [sys.executable, str(script), "grpo", str(tmp_path / "missing.yaml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert failed.returncode == 2 and "missing.yaml" in failed.stderr
