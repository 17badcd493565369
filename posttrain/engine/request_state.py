"""What the engine keeps of a request between steps (its samples' sequences, their text so far and the
detokenizers that track it), and the RequestOutput it reports from them.

Text is tracked token by token only where it is needed (stop strings, streaming); otherwise a finished sample's text
is decoded once, from its token ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.engine.outputs import CompletionOutput, RequestOutput
from posttrain.engine.prompt_logprobs import PromptLogprobs
from posttrain.engine.sampling_params import SamplingParams
from posttrain.engine.sequence import Sequence
from posttrain.engine.stop import IncrementalDetokenizer


@dataclass
class EngineRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    seqs: list[Sequence | None]  # by sample index; filled as the first sequence forks
    detokenizers: list[IncrementalDetokenizer | None] = field(default_factory=list)  # by sample index, when tracked
    texts: list[str | None] = field(default_factory=list)  # final text per sample, once finished
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # filled by the first sequence's prefill, when asked for

    def __post_init__(self) -> None:
        self.detokenizers = self.detokenizers or [None] * self.params.n
        self.texts = self.texts or [None] * self.params.n

    @property
    def finished(self) -> bool:
        return all(seq is not None and seq.is_finished for seq in self.seqs)

    def detokenizer(self, seq: Sequence, tokenizer: Any) -> IncrementalDetokenizer | None:
        """The sample's detokenizer, made on first need; None where its text is not tracked token by token (no
        tokenizer, or neither stop strings nor streaming)."""
        if tokenizer is None or not (seq.params.stop or self.stream):
            return None
        detok = self.detokenizers[seq.index]
        if detok is None:
            detok = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens)
            for token in seq.output_token_ids[:-1]:  # a fork arrives with its first token already appended
                detok.add(token)
            self.detokenizers[seq.index] = detok
        return detok

    def final_text(self, seq: Sequence, tokenizer: Any, drop_last: bool) -> str:
        """A finishing sample's text: the tracked text, else its tokens decoded (without the last one when
        `drop_last`: a stop token's text is never shown); '' without a tokenizer."""
        detok = self.detokenizers[seq.index]
        if detok is not None:
            return detok.text
        if tokenizer is None:
            return ""
        ids = seq.output_token_ids[:-1] if drop_last else seq.output_token_ids
        return tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)

    def current_text(self, index: int) -> str:
        """Sample `index`'s text: final once finished, else as tracked so far ('' when untracked)."""
        if self.texts[index] is not None:
            return self.texts[index]
        detok = self.detokenizers[index]
        return detok.text if detok is not None else ""

    def output(self) -> RequestOutput:
        """The request as reported: every sample's text, tokens, logprobs and policy versions so far."""
        want_logprobs = self.params.logprobs is not None and self.params.logprobs is not False
        outputs = []
        for index, seq in enumerate(self.seqs):
            if seq is None:  # not forked yet
                outputs.append(CompletionOutput(index, "", []))
                continue
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=self.current_text(index),
                    token_ids=seq.output_token_ids,
                    logprobs=list(seq.output_logprobs) if want_logprobs else None,
                    top_logprobs=list(seq.output_top_logprobs) if self.params.num_top_logprobs else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    policy_version=seq.policy_version,
                    token_policy_versions=list(seq.output_policy_versions),
                )
            )
        prompt_logprobs = self.prompt_logprobs
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=prompt_logprobs.entries() if prompt_logprobs else None,
            prompt_top_logprobs=prompt_logprobs.top_entries() if prompt_logprobs else None,
            prompt_logprob_ranks=prompt_logprobs.rank_entries() if prompt_logprobs else None,
        )
