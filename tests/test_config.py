"""posttrain.config: YAML + dotted overrides into typed dataclasses, and every error it names."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from posttrain.config import config_to_dict, load_config, parse_cli_config, save_config
from posttrain.errors import ConfigError


@dataclass
class OptimConfig:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 0

    def validate(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclass
class LoraConfig:
    r: int = 8
    alpha: float = 16.0
    targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])

    def validate(self) -> None:
        if self.r <= 0:
            raise ValueError(f"r must be positive, got {self.r}")


@dataclass
class DataConfig:
    path: Path = Path("data/train.jsonl")
    max_len: int = 512
    weights: dict[str, float] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)


class Precision(enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"


@dataclass
class TrainConfig:
    model: str = "tiny"
    seed: int = 0
    max_steps: int = 100
    packing: bool = False
    run_name: str | None = None
    precision: Precision = Precision.FP32
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig | None = None

    def validate(self) -> None:
        if self.lora is not None and self.packing:
            raise ValueError("packing does not work with lora in this test config")


@dataclass
class RequiredConfig:
    dataset: str
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class TunedDefaults:
    # The section's default comes from a factory with non-class values: touching one key keeps the rest.
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, warmup_steps=50))
    lora: LoraConfig | None = field(default_factory=lambda: LoraConfig(r=4))


@dataclass
class RewardSpec:
    name: str
    weight: float = 1.0


@dataclass
class RewardsConfig:
    rewards: list[RewardSpec] = field(default_factory=list)


@dataclass
class PostInitConfig:
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------- building


def test_defaults_without_file_or_overrides():
    assert load_config(TrainConfig) == TrainConfig()


def test_yaml_file_builds_nested_sections(tmp_path):
    path = write(
        tmp_path,
        """
model: smol
optim:
  lr: 1.0e-5
  schedule: linear
data:
  path: data/x.jsonl
  weights: {math: 2.0, code: 1}
  stop: ["</s>", "<|im_end|>"]
""",
    )
    cfg = load_config(TrainConfig, path)
    assert cfg.model == "smol"
    assert cfg.optim == OptimConfig(lr=1e-5, schedule="linear")
    assert cfg.data.path == Path("data/x.jsonl")
    assert cfg.data.weights == {"math": 2.0, "code": 1.0}
    assert isinstance(cfg.data.weights["code"], float)
    assert cfg.data.stop == ["</s>", "<|im_end|>"]
    assert cfg.lora is None


def test_overrides_apply_after_file_in_order(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 0.1\nseed: 1\n")
    cfg = load_config(TrainConfig, path, ["optim.lr=1e-5", "seed=2", "seed=3"])
    assert cfg.optim.lr == 1e-5 and isinstance(cfg.optim.lr, float)
    assert cfg.seed == 3


def test_base_dict_sits_between_defaults_and_file(tmp_path):
    path = write(tmp_path, "seed: 7\n")
    cfg = load_config(TrainConfig, path, base={"seed": 1, "model": "from-base", "optim": {"lr": 0.5}})
    assert (cfg.seed, cfg.model, cfg.optim.lr) == (7, "from-base", 0.5)


@pytest.mark.parametrize(
    "override, attr, expected",
    [
        ("optim.lr=1e-5", ("optim", "lr"), 1e-5),  # a string to PyYAML, a float to us
        ("optim.lr=3", ("optim", "lr"), 3.0),  # an int is fine for a float field
        ("max_steps=1e4", ("max_steps",), 10_000),  # integral scientific notation for an int
        ("packing=yes", ("packing",), True),
        ("packing=true", ("packing",), True),
        ("packing=False", ("packing",), False),
        ("model=007", ("model",), "007"),  # a str field keeps the text as typed
        ("model=yes", ("model",), "yes"),
        ("model=a: b", ("model",), "a: b"),  # not even YAML: still fine text
        ("run_name=null", ("run_name",), None),
        ("run_name=exp-1", ("run_name",), "exp-1"),
        ("data.path=x.jsonl", ("data", "path"), Path("x.jsonl")),
        ("data.stop=[a,b]", ("data", "stop"), ["a", "b"]),
        ("data.weights={a: 1.0, b: 2}", ("data", "weights"), {"a": 1.0, "b": 2.0}),
        ("optim.betas=[0.8, 0.99]", ("optim", "betas"), (0.8, 0.99)),
        ("optim.schedule=linear", ("optim", "schedule"), "linear"),
        ("precision=bf16", ("precision",), Precision.BF16),
        ("optim={lr: 0.25}", ("optim", "lr"), 0.25),
        ("max-steps=5", ("max_steps",), 5),  # dashes as in CLI habit
    ],
)
def test_override_coercion(override, attr, expected):
    value = load_config(TrainConfig, overrides=[override])
    for name in attr:
        value = getattr(value, name)
    assert value == expected
    assert type(value) is type(expected)


def test_mapping_override_merges_into_section():
    cfg = load_config(TrainConfig, overrides=["optim.warmup_steps=5", "optim={lr: 0.25}"])
    assert (cfg.optim.lr, cfg.optim.warmup_steps) == (0.25, 5)


def test_dict_entry_override_updates_one_entry(tmp_path):
    path = write(tmp_path, "data:\n  weights: {a: 1.0, b: 2.0}\n")
    cfg = load_config(TrainConfig, path, ["data.weights.b=5", "data.weights.c=0.5"])
    assert cfg.data.weights == {"a": 1.0, "b": 5.0, "c": 0.5}


def test_yaml_scientific_notation_string_becomes_float(tmp_path):
    cfg = load_config(TrainConfig, write(tmp_path, "optim:\n  lr: 1e-5\n"))
    assert cfg.optim.lr == 1e-5


# ----------------------------------------------------------------------------- optional sections


def test_optional_section_created_with_defaults_by_one_key():
    cfg = load_config(TrainConfig, overrides=["lora.r=16"])
    assert cfg.lora == LoraConfig(r=16)


def test_optional_section_created_from_yaml_and_disabled_by_null(tmp_path):
    path = write(tmp_path, "lora:\n  alpha: 32\n")
    assert load_config(TrainConfig, path).lora == LoraConfig(alpha=32.0)
    assert load_config(TrainConfig, path, ["lora=null"]).lora is None
    assert load_config(TrainConfig, write(tmp_path, "lora: {}\n", "empty.yaml")).lora == LoraConfig()


def test_null_then_key_recreates_section():
    cfg = load_config(TrainConfig, overrides=["lora=null", "lora.r=2"])
    assert cfg.lora == LoraConfig(r=2)


def test_touching_a_section_keeps_its_factory_defaults():
    cfg = load_config(TunedDefaults, overrides=["optim.schedule=constant", "lora.alpha=1"])
    assert cfg.optim == OptimConfig(lr=1e-3, warmup_steps=50, schedule="constant")
    assert cfg.lora == LoraConfig(r=4, alpha=1.0)
    # and the factory result is not shared between loads
    assert load_config(TunedDefaults).lora == LoraConfig(r=4)


def test_list_of_dataclasses(tmp_path):
    path = write(tmp_path, "rewards:\n  - {name: acc}\n  - name: fmt\n    weight: 0.5\n")
    cfg = load_config(RewardsConfig, path)
    assert cfg.rewards == [RewardSpec("acc"), RewardSpec("fmt", 0.5)]


def test_required_field_missing_and_given(tmp_path):
    with pytest.raises(ConfigError, match=r"missing required key 'dataset'"):
        load_config(RequiredConfig)
    assert load_config(RequiredConfig, overrides=["dataset=x"]).dataset == "x"


def test_empty_yaml_file_means_defaults(tmp_path):
    assert load_config(TrainConfig, write(tmp_path, "# only a comment\n")) == TrainConfig()


# ----------------------------------------------------------------------------- errors


def test_unknown_key_in_yaml_names_file_line_and_suggests(tmp_path):
    path = write(tmp_path, "model: x\noptim:\n  lr: 0.1\n  wieght_decay: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, path)
    message = str(e.value)
    assert f"{path}:4" in message
    assert "unknown key 'optim.wieght_decay'" in message
    assert "did you mean 'optim.weight_decay'" in message


def test_unknown_key_in_override_suggests_key_in_another_section():
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, overrides=["lr=1e-5"])
    assert "override 'lr=1e-5'" in str(e.value)
    assert "did you mean 'optim.lr'" in str(e.value)


def test_unknown_key_without_close_match_lists_the_section_keys():
    with pytest.raises(ConfigError, match=r"unknown key 'lora.zzz' \(LoraConfig has: r, alpha, targets\)"):
        load_config(TrainConfig, overrides=["lora.zzz=1"])


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("optim.lr=abc", "optim.lr: expected float, got 'abc' (str)"),
        ("optim.lr=true", "optim.lr: expected float, got True (bool)"),
        ("max_steps=2.5", "max_steps: expected int, got 2.5 (float)"),
        ("packing=1", "packing: expected bool, got 1 (int)"),
        ("data.stop=a", "data.stop: expected a list[str] (write [a, b]), got 'a' (str)"),
        ("data.weights={a: x}", "data.weights.a: expected float, got 'x' (str)"),
        ("data.weights=[1]", "data.weights: expected a dict[str, float]"),
        ("optim.betas=[1, 2, 3]", "optim.betas: expected 2 items"),
        ("optim=3", "optim: expected a mapping of OptimConfig keys, got 3 (int)"),
        ("optim=null", "optim: is a required OptimConfig section and cannot be null"),
        ("optim.lr.x=1", "optim.lr.x: 'optim.lr' is a float, not a section"),
        ("precision=fp8", "precision: must be one of 'fp32', 'bf16'; got 'fp8' (str)"),
    ],
)
def test_wrong_type_override_names_key_and_value(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, overrides=[override])
    assert f"override '{override}'" in str(e.value)
    assert fragment in str(e.value)


def test_wrong_type_in_yaml_names_line(tmp_path):
    path = write(tmp_path, "seed: 1\ndata:\n  max_len: long\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: data.max_len: expected int, got 'long' \(str\)$"):
        load_config(TrainConfig, path)


def test_wrong_list_item_in_yaml_names_its_own_line(tmp_path):
    path = write(tmp_path, "data:\n  stop:\n    - a\n    - 5\n")
    expected = rf"^{path}:4: data.stop\[1\]: expected str, got 5 \(int\); quote it"
    with pytest.raises(ConfigError, match=expected):
        load_config(TrainConfig, path)


def test_literal_choice_error_suggests_close_choice(tmp_path):
    path = write(tmp_path, "optim:\n  schedule: cosin\n")
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, path)
    assert f"{path}:2: optim.schedule: must be one of 'cosine', 'linear', 'constant'" in str(e.value)
    assert "did you mean 'cosine'" in str(e.value)


def test_malformed_override_without_equals():
    with pytest.raises(ConfigError, match=r"override 'optim.lr': expected key=value"):
        load_config(TrainConfig, overrides=["optim.lr"])
    with pytest.raises(ConfigError, match=r"expected key=value"):
        load_config(TrainConfig, overrides=["optim..lr=1"])


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "model: x\noptim:\n  lr: [1, 2\nseed: 3\n")
    with pytest.raises(ConfigError, match=rf"^{path}:\d+: YAML syntax error"):
        load_config(TrainConfig, path)


def test_tab_indentation_is_a_syntax_error_with_line(tmp_path):
    path = write(tmp_path, "optim:\n\tlr: 1\n")
    with pytest.raises(ConfigError, match=rf"^{path}:2: YAML syntax error"):
        load_config(TrainConfig, path)


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "a list"), ("just text\n", "the value 'just text'")])
def test_top_level_must_be_mapping(tmp_path, text, kind):
    path = write(tmp_path, text)
    expected = rf"^{path}:1: top level must be a mapping of config keys, got {kind}"
    with pytest.raises(ConfigError, match=expected):
        load_config(TrainConfig, path)


def test_duplicate_yaml_key_is_an_error(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: duplicate key 'optim.lr' \(first on line 2\)"):
        load_config(TrainConfig, path)


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    path = write(tmp_path, "data:\n  weights: &w {a: 1.0}\noptim: {lr: 0.5}\n")
    assert load_config(TrainConfig, path).data.weights == {"a": 1.0}


def test_missing_file():
    with pytest.raises(ConfigError, match=r"nope.yaml: config file not found"):
        load_config(TrainConfig, "nope.yaml")


def test_validate_error_names_section_and_sees_overrides(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=rf"^{path}: optim: lr must be > 0, got -1.0$"):
        load_config(TrainConfig, path, ["optim.lr=-1"])
    with pytest.raises(ConfigError, match=r"^config: lora: r must be positive"):
        load_config(TrainConfig, overrides=["lora.r=0"])


def test_validate_on_root_runs_after_children():
    with pytest.raises(ConfigError, match=r"^config: TrainConfig: packing does not work with lora"):
        load_config(TrainConfig, overrides=["packing=true", "lora={}"])


def test_post_init_value_error_becomes_config_error():
    with pytest.raises(ConfigError, match=r"^config: PostInitConfig: temperature must be >= 0"):
        load_config(PostInitConfig, overrides=["temperature=-1"])


def test_non_dataclass_and_string_overrides_are_programming_errors():
    with pytest.raises(TypeError):
        load_config(dict)
    with pytest.raises(TypeError):
        load_config(TrainConfig, overrides="seed=1")


# ----------------------------------------------------------------------------- round trip


def test_save_and_load_round_trip(tmp_path):
    cfg = load_config(
        TrainConfig,
        overrides=[
            "model=yes",
            "run_name=007",
            "optim.lr=1e-7",
            "optim.betas=[0.5, 0.6]",
            "data.path=/tmp/x y.jsonl",
            "data.weights={a: 0.1}",
            "data.stop=['null', '1']",
            "lora.targets=[o_proj]",
            "precision=bf16",
        ],
    )
    path = tmp_path / "saved.yaml"
    save_config(cfg, path)
    assert load_config(TrainConfig, path) == cfg
    assert not list(tmp_path.glob("*.tmp"))


def test_config_to_dict_is_plain_data():
    plain = config_to_dict(load_config(TrainConfig, overrides=["lora.r=2"]))
    assert plain["data"]["path"] == "data/train.jsonl"
    assert plain["optim"]["betas"] == [0.9, 0.95]
    assert plain["precision"] == "fp32"
    assert plain["lora"]["r"] == 2
    assert config_to_dict(TrainConfig())["lora"] is None
    with pytest.raises(TypeError):
        config_to_dict({"a": 1})


# ----------------------------------------------------------------------------- CLI argv


def test_parse_cli_config_all_spellings(tmp_path):
    path = write(tmp_path, "seed: 5\noptim:\n  lr: 0.1\n")
    cfg = parse_cli_config(
        TrainConfig,
        [str(path), "data.path=x.jsonl", "--optim.weight_decay", "-1e-5", "--max_steps=9"]
        + ["data.max_len=16", "--packing"],
    )
    assert cfg.seed == 5
    assert cfg.data.path == Path("x.jsonl")
    assert cfg.optim.weight_decay == -1e-5  # a value that starts with one dash is still a value
    assert cfg.max_steps == 9 and cfg.data.max_len == 16 and cfg.packing is True


def test_parse_cli_config_without_file():
    cfg = parse_cli_config(TrainConfig, ["--seed", "3", "--packing", "--model=m"])
    assert (cfg.seed, cfg.packing, cfg.model) == (3, True, "m")
    assert parse_cli_config(TrainConfig, []) == TrainConfig()


def test_parse_cli_config_errors():
    with pytest.raises(ConfigError, match=r"'cfg.json': expected a YAML config file"):
        parse_cli_config(TrainConfig, ["cfg.json"])
    with pytest.raises(ConfigError, match=r"'b.yaml': the config file must come first"):
        parse_cli_config(TrainConfig, ["seed=1", "b.yaml"])
    with pytest.raises(ConfigError, match=r"override 'oops': expected key=value"):
        parse_cli_config(TrainConfig, ["seed=1", "oops"])
    with pytest.raises(ConfigError, match=r"'--': expected --key value"):
        parse_cli_config(TrainConfig, ["--"])


@dataclass
class UnionConfig:
    device: int | str = "auto"
    limit: float | None = 1.0


def test_union_fields_take_the_first_type_that_fits(tmp_path):
    assert load_config(UnionConfig, overrides=["device=3"]).device == 3
    assert load_config(UnionConfig, overrides=["device=cuda:1"]).device == "cuda:1"
    assert load_config(UnionConfig, overrides=["limit=1e-3"]).limit == 1e-3
    assert load_config(UnionConfig, overrides=["limit=~"]).limit is None
    # An override's text always fits a str; a YAML list does not.
    assert load_config(UnionConfig, overrides=["device=[1]"]).device == "[1]"
    with pytest.raises(ConfigError, match=r":1: device: expected int \| str, got \[1\] \(list\)"):
        load_config(UnionConfig, write(tmp_path, "device: [1]\n"))
