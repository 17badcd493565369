"""EngineConfig: the knobs of the rollout engine, checked when the dataclass is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from posttrain.engine.attention_backend import ATTENTION_BACKENDS
from posttrain.engine.speculative.config import SpeculativeConfig, as_speculative_config
from posttrain.errors import ConfigError

COMPUTE_DTYPES = ("auto", "float32", "bfloat16")  # EngineConfig.compute_dtype's values


class EngineConfigError(ConfigError, ValueError):
    """A bad EngineConfig value. A ValueError too, so `load_config` adds the file and line to it."""


@dataclass
class EngineConfig:
    """How the engine lays out its KV cache and batches its work.

    KV pool size, first that applies: `num_kv_blocks`; else `kv_cache_bytes`; else
    `kv_cache_memory_fraction` of the device memory that is free when the engine starts.
    """

    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.25
    max_num_seqs: int = 512  # sequences in one step
    max_num_batched_tokens: int = 4096  # new tokens in one step (prefill chunks + decodes)
    max_model_len: int | None = None  # prompt + output tokens; None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    watermark: float = 0.01  # fraction of blocks kept free when admitting a new sequence (less preemption)
    cuda_graphs: bool = False  # capture decode steps as CUDA graphs (CUDA only)
    # The kernel that attends over the KV pool (posttrain/engine/attention_backend.py): auto picks flash-attn
    # on CUDA when installed and block_size allows it, else FlexAttention on CUDA; on CPU the C kernels.
    attention_backend: Literal["auto", "cpu", "reference", "flex", "flash"] = "auto"
    # On CPU with glibc: keep freed memory in the heap instead of returning it to the OS, so the large
    # per-step temporaries do not page-fault on every step (3-4x faster steps on the machines we measured).
    # glibc's `hold` policy (posttrain.cpu_malloc) while generate() runs; a process that set no policy of
    # its own keeps it from the engine's start. Set False to leave malloc alone.
    tune_cpu_allocator: bool = True
    # On CPU in fp32: MKL-packed copies of the linear weights while generating (posttrain/engine/packed_weights.py);
    # faster matmuls for one more copy of the weights in memory. Set False to keep that memory.
    pack_cpu_weights: bool = True
    # On CPU: the native C kernels (posttrain/kernels, built on first use): the paged decode attention, the K/V
    # writes, the fused norm / RoPE / SwiGLU ops and the sampler's one-pass draw. False: PyTorch ops only.
    # POSTTRAIN_CPU_KERNELS=0 in the environment turns them off for the whole process, whatever this says.
    cpu_kernels: bool = True
    # On CPU in fp32 with the native kernels: a decode step of at most 8 sequences runs the whole decoder in one
    # native call (posttrain/engine/native_decode.py), bit for bit the module path's result without its per-op
    # Python (batch-1 serving: ~1.4x tokens/s). False: every step through the modules.
    native_decode_step: bool = True
    # The dtype the forwards compute in (posttrain/engine/bf16_weights.py). auto: bf16 over fp32 weights on a CPU
    # with fast bf16 (AVX512-BF16 / AMX; `posttrain info` says which), else the weights' own dtype. bfloat16 over
    # fp32 weights: bf16 copies of the linear weights (half their fp32 bytes more) and a bf16 KV cache; norms,
    # softmax, logits and logprobs in fp32. float32: never bf16 over fp32 weights.
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Chained decode steps (posttrain/engine/chained_steps.py): a decode step of a few sequences that all draw
    # greedily, or all by plain temperature sampling, runs up to this many steps in one native call when nothing waits
    # to be admitted (the native decode step's conditions), each step's tokens feeding the next; the same tokens and
    # logprobs, with the per-token Python paid once per chain (batch-1 q8_0 on a 2-core Zen 5: 97 -> 127 tokens/s).
    # Streaming then shows up to this many tokens at a time. 1: one step at a time.
    decode_steps: int = 8
    # Speculative decoding (posttrain/engine/speculative, docs/engine.md): None (off), or which proposer drafts
    # tokens for decoding sequences and how many per step. Also given as a mapping or a method name ("ngram").
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        self.validate()

    def reserve_blocks(self, num_blocks: int) -> int:
        """Blocks of a pool of `num_blocks` that admissions, draft checks and chained steps leave free for the
        running sequences' next tokens (the watermark)."""
        return int(self.watermark * num_blocks)

    def validate(self) -> None:
        self.speculative = as_speculative_config(self.speculative)
        _positive_int("block_size", self.block_size)
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_bytes is not None:
            _positive_int("kv_cache_bytes", self.kv_cache_bytes)
        fraction = self.kv_cache_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise EngineConfigError(f"kv_cache_memory_fraction={fraction!r}: must be in (0, 1]")
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("decode_steps", self.decode_steps)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence must be able to decode in one step, or the last ones would starve.
            raise EngineConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens}: must be >= max_num_seqs={self.max_num_seqs}"
            )
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if (
            isinstance(self.watermark, bool)
            or not isinstance(self.watermark, (int, float))
            or not 0 <= self.watermark < 1
        ):
            raise EngineConfigError(f"watermark={self.watermark!r}: must be in [0, 1)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise EngineConfigError(
                f"attention_backend={self.attention_backend!r}: must be one of {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise EngineConfigError(f"compute_dtype={self.compute_dtype!r}: must be one of {', '.join(COMPUTE_DTYPES)}")
        for name in (
            "enable_prefix_caching",
            "cuda_graphs",
            "tune_cpu_allocator",
            "pack_cpu_weights",
            "cpu_kernels",
            "native_decode_step",
        ):
            if not isinstance(getattr(self, name), bool):
                raise EngineConfigError(f"{name}={getattr(self, name)!r}: must be true or false")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EngineConfigError(f"{name}={value!r}: must be a positive integer")
