"""From the API's requests to SamplingParams, and from engine outputs to the API's responses and chunks."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from posttrain.engine.outputs import CompletionOutput, RequestOutput
from posttrain.engine.sampling_params import SamplingParams
from posttrain.engine.stop import safe_text_len
from posttrain.serve.errors import APIError
from posttrain.serve.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    SamplingFields,
    TokenLogprob,
    TopLogprob,
    Usage,
)

_FIELD_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)")


def sampling_params(
    req: SamplingFields,
    max_tokens: int,
    logprobs: bool | int | None,
    prompt_logprobs: int | None = None,
    prompt_ranks: bool = False,
) -> SamplingParams:
    """SamplingParams for a validated request; a combination the engine refuses becomes a 400 naming the field.
    `prompt_logprobs` (echo with logprobs, or vLLM's prompt_logprobs) makes the engine score the prompt too;
    None leaves it off. `prompt_ranks`: with the prompt tokens' ranks (vLLM's prompt_logprobs shows them)."""
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            stop=req.stop,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            prompt_logprob_ranks=prompt_ranks,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as error:
        match = _FIELD_IN_MESSAGE.search(str(error))
        raise APIError(str(error).replace("SamplingParams.", ""), param=match.group(1) if match else None) from None


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


# ---- logprobs --------------------------------------------------------------------------------------


class TokenText:
    """The text of single token ids, as logprobs report them (cached: the same ids recur)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def completion_logprobs(
    token_text: TokenText,
    token_ids: list[int],
    logprobs: list[float | None],
    top: list[list[tuple[int, float]] | None] | None,
    offset: int = 0,
) -> CompletionLogprobs:
    """The legacy completions format: parallel lists, `text_offset` from `offset` (chars already streamed,
    or the echoed prompt's length). A None entry (the first prompt token) stays None in both lists."""
    tokens = [token_text(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=logprobs,
        top_logprobs=[_top_dict(token_text, step) for step in top] if top is not None else None,
        text_offset=offsets,
    )


def _top_dict(token_text: TokenText, step: list[tuple[int, float]] | None) -> dict[str, float] | None:
    return None if step is None else {token_text(t): lp for t, lp in step}


def echo_logprobs(
    token_text: TokenText, request: RequestOutput, prompt_text: str, out: CompletionOutput, num_top: int
) -> CompletionLogprobs:
    """Logprobs over the echoed text: the prompt's tokens (the engine's prompt_logprobs, raw log-softmax,
    None first) and then the sample's, whose offsets start after the prompt text they follow. The engine may
    hold more prompt alternatives than num_top (for a larger `prompt_logprobs` in the same request)."""
    top = num_top > 0
    prompt_top = [None if step is None else step[:num_top] for step in request.prompt_top_logprobs] if top else None
    head = completion_logprobs(token_text, request.prompt_token_ids, request.prompt_logprobs or [], prompt_top)
    tail = completion_logprobs(
        token_text, out.token_ids, out.logprobs or [], out.top_logprobs if top else None, offset=len(prompt_text)
    )
    return CompletionLogprobs(
        tokens=head.tokens + tail.tokens,
        token_logprobs=head.token_logprobs + tail.token_logprobs,
        top_logprobs=(head.top_logprobs or []) + (tail.top_logprobs or []) if top else None,
        text_offset=head.text_offset + tail.text_offset,
    )


def prompt_logprobs(token_text: TokenText, request: RequestOutput, num_top: int) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), its own logprob and rank and those of
    the num_top most likely tokens (rank = place among them), keyed by token id."""
    entries: PromptLogprobs = [None]
    tops = request.prompt_top_logprobs or [None] * len(request.prompt_token_ids)
    for token, logprob, rank, top in zip(
        request.prompt_token_ids[1:], request.prompt_logprobs[1:], request.prompt_logprob_ranks[1:], tops[1:]
    ):
        entry = {str(token): PromptLogprob(logprob=logprob, rank=rank, decoded_token=token_text(token))}
        for place, (alternative, alternative_logprob) in enumerate((top or [])[:num_top], start=1):
            entry.setdefault(
                str(alternative),
                PromptLogprob(logprob=alternative_logprob, rank=place, decoded_token=token_text(alternative)),
            )
        entries.append(entry)
    return entries


def chat_logprobs(
    token_text: TokenText, token_ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]] | None
) -> ChatLogprobs:
    content = []
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
        token = token_text(token_id)
        alternatives = [
            TopLogprob(token=token_text(t), logprob=lp, bytes=list(token_text(t).encode()))
            for t, lp in (top[i] if top is not None else [])
        ]
        content.append(
            TokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()), top_logprobs=alternatives)
        )
    return ChatLogprobs(content=content)


# ---- streaming -------------------------------------------------------------------------------------


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None
    text_offset: int  # characters of this sample streamed before this delta


class DeltaTracker:
    """What one sample added since the last chunk. Text that could still grow into a stop string is held
    back until it cannot, so a stop string never reaches the client."""

    def __init__(self, stop: list[str]) -> None:
        self._stop = stop
        self.sent_text = 0
        self.sent_tokens = 0
        self.finished = False

    def update(self, out: CompletionOutput) -> Delta | None:
        if self.finished or (not out.token_ids and not out.finished):
            return None
        visible = len(out.text) if out.finished else safe_text_len(out.text, self._stop)
        start_text, start_tokens = self.sent_text, self.sent_tokens
        delta = Delta(
            text=out.text[start_text:visible],
            token_ids=out.token_ids[start_tokens:],
            logprobs=out.logprobs[start_tokens:] if out.logprobs is not None else None,
            top_logprobs=out.top_logprobs[start_tokens:] if out.top_logprobs is not None else None,
            finish_reason=finish_reason(out.finish_reason),
            text_offset=start_text,
        )
        self.sent_text = max(start_text, visible)
        self.sent_tokens = len(out.token_ids)
        self.finished = out.finished
        if delta.text or delta.token_ids or delta.finish_reason:
            return delta
        return None


def finish_reason(reason: str | None) -> str | None:
    """Engine reasons are OpenAI's ("stop", "length"); an abort is reported as a stop."""
    return "stop" if reason == "abort" else reason
