"""What the engine hands back: one RequestOutput per request, one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One sample. `logprobs[i]` is log_softmax(logits / T)[token_ids[i]] over the full vocabulary (see
    docs/engine.md); None unless the request asked for logprobs. `policy_version`: the engine's weight
    version when this sample's first token was drawn; `token_policy_versions[i]`: the version under which
    token_ids[i] was drawn (they differ when the weights change while the sample runs)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # with logprobs=k > 0: k (token, logprob) per step
    finish_reason: str | None = None  # "stop" (EOS, stop token or stop string) | "length" | "abort"; None: running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    policy_version: int | None = None
    token_policy_versions: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else float(sum(self.logprobs))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts
    # it), else log_softmax(raw logits at the position before)[token] (no temperature, no penalties).
    prompt_logprobs: list[float | None] | None = None
    # With prompt_logprobs=k > 0: per prompt token (None for the first), the k most likely (token, logprob).
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # With prompt_logprob_ranks: per prompt token (None for the first), its rank by logit (1 = the most likely).
    prompt_logprob_ranks: list[int | None] | None = None

    @property
    def policy_version(self) -> int | None:
        """The oldest weight version among the samples (they differ only if weights changed mid-request)."""
        versions = [o.policy_version for o in self.outputs if o.policy_version is not None]
        return min(versions) if versions else None


@dataclass
class StreamDelta:
    """What one sample produced since the last delta: text held back while it could still turn into a
    stop string, so a stop string never leaks."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    policy_version: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
