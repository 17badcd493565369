"""What `posttrain estimate` estimates: the model's shapes (`Architecture`) and how it is trained, per
device (`TrainingSetup`). Both are frozen dataclasses validated on construction; memory.py, compute.py and
trainer_rules.py read them, and this module imports none of those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from posttrain.errors import PosttrainError
from posttrain.models.config import ModelConfig

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}

ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
ALL_LINEARS = ATTENTION_LINEARS + MLP_LINEARS

OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "sgd": 1}  # AdamW: exp_avg, exp_avg_sq; SGD: momentum buffer

Method = Literal["full", "lora", "qlora"]
Trainer = Literal["sft", "dpo", "rm", "grpo", "ppo"]  # the keys of trainer_rules.TRAINERS (a test checks)
TRAINER_NAMES: tuple[str, ...] = get_args(Trainer)


def dtype_bytes(dtype: str) -> int:
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPE_BYTES:
        raise PosttrainError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


# ----------------------------------------------------------------------------- the model's shapes


@dataclass(frozen=True)
class Architecture:
    """The shapes that memory depends on. `params` overrides the count implied by the shapes."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    params: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PosttrainError(f"{name} must be a positive integer, got {value!r}")
        if self.heads % self.kv_heads:
            raise PosttrainError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.params is not None and self.params < 1:
            raise PosttrainError(f"params must be positive, got {self.params}")

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> Architecture:
        return cls(
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.vocab_size,
            cfg.tie_word_embeddings,
            cfg.attention_bias,
            cfg.qk_norm,
        )

    @classmethod
    def from_model(cls, name_or_path: str) -> Architecture:
        """The architecture of a model (HF directory, GGUF file or known name) from its config alone:
        no weights are read (a GGUF is converted into the cache on first use, as every command does)."""
        from posttrain.models.checkpoint_io import read_hf_config
        from posttrain.models.hub import resolve_model_path

        return cls.from_model_config(read_hf_config(resolve_model_path(name_or_path)))

    @classmethod
    def from_params(
        cls,
        params: int,
        layers: int,
        hidden: int,
        heads: int | None = None,
        kv_heads: int | None = None,
        vocab: int | None = None,
        intermediate: int | None = None,
        head_dim: int | None = None,
        tied_embeddings: bool = False,
    ) -> Architecture:
        """A hypothetical model of `params` parameters. Unset shapes get the common defaults (128-wide
        heads, MHA, a 32k vocabulary); an unset intermediate size is solved from `params`."""
        heads = heads or max(hidden // 128, 1)
        head_dim = head_dim or hidden // heads
        kv_heads = kv_heads or heads
        vocab = vocab or 32000
        if intermediate is None:
            attn = hidden * heads * head_dim * 2 + 2 * hidden * kv_heads * head_dim
            embed = vocab * hidden * (1 if tied_embeddings else 2)
            per_layer = (params - embed - hidden) / layers - attn - 2 * hidden
            intermediate = int(per_layer // (3 * hidden))
            if intermediate < 1:
                raise PosttrainError(
                    f"--params {params} is too small for {layers} layers of width {hidden} and a "
                    f"{vocab}-token vocabulary (the embeddings alone are {embed} parameters)"
                )
        return cls(layers, hidden, intermediate, heads, kv_heads, head_dim, vocab, tied_embeddings, params=params)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each decoder linear, by module name."""
        d, f, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "q_proj": (d, q),
            "k_proj": (d, kv),
            "v_proj": (d, kv),
            "o_proj": (q, d),
            "gate_proj": (d, f),
            "up_proj": (d, f),
            "down_proj": (f, d),
        }

    @property
    def linear_params(self) -> int:
        """Weights of the decoder linears, all layers (what QLoRA quantizes and LoRA can target)."""
        return self.layers * sum(i * o for i, o in self.linear_shapes().values())

    @property
    def shape_params(self) -> int:
        """The count implied by the shapes (the formula of ModelConfig.num_parameters)."""
        d, hd = self.hidden, self.head_dim
        layer = sum(i * o for i, o in self.linear_shapes().values()) + 2 * d
        if self.attention_bias:
            layer += (self.heads + 2 * self.kv_heads) * hd
        if self.qk_norm:
            layer += 2 * hd
        return self.layers * layer + self.vocab * d * (1 if self.tied_embeddings else 2) + d

    @property
    def num_parameters(self) -> int:
        return self.params if self.params is not None else self.shape_params

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes


# ----------------------------------------------------------------------------- the training setup


@dataclass(frozen=True)
class TrainingSetup:
    """How the model is trained, per device. Sizes are per device: `batch` sequences per micro-batch."""

    method: Method = "full"
    optimizer: str = "adamw"
    dtype: str = "float32"  # weights and compute
    mixed: bool = False  # fp32 master weights and fp32 optimizer states over half-precision weights
    zero: int = 0  # ZeRO / FSDP stage: 1 shards optimizer states, 2 also gradients, 3 also weights
    gpus: int = 1
    batch: int = 1  # per micro-batch: SFT sequences, DPO / RM pairs, RL samples (TrainerRules.batch)
    seq_len: int = 512  # tokens per sequence, prompt + completion
    prompt_len: int = 0  # of seq_len: tokens with no loss (SFT completion-only loss; the DPO and RL prompt)
    grad_accum: int = 1  # micro-batches per optimizer step
    trainer: Trainer = "sft"
    group_size: int = 8  # RL: samples per prompt, packed into one row with the prompt once
    rollout_seqs: int | None = None  # RL: sequences the KV pool holds at once; None: batch
    kv_tokens: int | None = None  # RL: KV pool size in tokens; None: rollout_seqs x seq_len, whole blocks
    lora_r: int = 16
    lora_targets: tuple[str, ...] = ALL_LINEARS
    quant_bits: int = 4  # QLoRA base
    quant_group: int = 64  # QLoRA: weights per fp16 scale
    reference: bool = False  # a live frozen reference (RL KL, DPO reference=live); with LoRA the base serves
    checkpointing: bool = False  # which activation figure goes into total_bytes
    overhead_bytes: int = 0  # the runtime's own memory (interpreter, libraries, CUDA context)

    def __post_init__(self) -> None:
        if self.method not in ("full", "lora", "qlora"):
            raise PosttrainError(f"method {self.method!r} is not one of full, lora, qlora")
        if self.optimizer not in OPTIMIZER_STATES:
            raise PosttrainError(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZER_STATES)}")
        if self.trainer not in TRAINER_NAMES:
            raise PosttrainError(f"trainer {self.trainer!r} is not one of {', '.join(TRAINER_NAMES)}")
        if self.reference and self.trainer == "rm":
            raise PosttrainError("reference: the rm trainer has no reference model (it trains a score head on pairs)")
        dtype_bytes(self.dtype)
        if self.zero not in (0, 1, 2, 3):
            raise PosttrainError(f"zero stage must be 0, 1, 2 or 3, got {self.zero}")
        for name in ("gpus", "batch", "seq_len", "grad_accum", "group_size", "lora_r", "quant_group"):
            if getattr(self, name) < 1:
                raise PosttrainError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.prompt_len < self.seq_len:
            raise PosttrainError(f"prompt-len must be in [0, seq-len={self.seq_len}), got {self.prompt_len}")
        if self.quant_bits not in (4, 8):
            raise PosttrainError(f"quant bits must be 4 or 8, got {self.quant_bits}")
        for name in ("rollout_seqs", "kv_tokens", "overhead_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise PosttrainError(f"{name.replace('_', '-')} must be >= 0, got {value}")
        unknown = [t for t in self.lora_targets if t not in ALL_LINEARS]
        if unknown or not self.lora_targets:
            raise PosttrainError(f"lora targets {list(self.lora_targets)}: choose from {', '.join(ALL_LINEARS)}")

    @property
    def element_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def trainable_bytes(self) -> int:
        """Element size of the trainable parameters: the model dtype, except QLoRA adapters, which are
        fp32 (LoRALinear gives adapters the base weight's dtype, and a quantized base has no float one)."""
        return 4 if self.method == "qlora" else self.element_bytes

    @property
    def completion_len(self) -> int:
        return self.seq_len - self.prompt_len
