"""The rollout engine: paged KV cache, continuous batching, prefix sharing, over the training module."""

from posttrain.engine.config import EngineConfig
from posttrain.engine.llm import LLM
from posttrain.engine.llm_engine import LLMEngine
from posttrain.engine.outputs import CompletionOutput, RequestOutput, StreamDelta
from posttrain.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "StreamDelta"]
