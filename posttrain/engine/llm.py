"""LLM: the offline face of the engine. Prompts (text, chat messages or token ids) in, completions out.

llm = LLM(model="smollm2-135m")                      # load by name / path
llm = LLM(model="smollm2-135m", quant="int8")        # int8 weight-only decode (inference only)
llm = LLM(model=module, tokenizer=tok)               # or wrap the live module a trainer is updating
outs = llm.generate(prompts, SamplingParams(n=8, temperature=1.0, max_tokens=128, logprobs=True))
for delta in llm.stream("Tell me a joke", SamplingParams(max_tokens=64)): print(delta.text, end="")
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from posttrain.engine.config import EngineConfig
from posttrain.engine.llm_engine import LLMEngine
from posttrain.engine.outputs import CompletionOutput, RequestOutput, StreamDelta
from posttrain.engine.sampling_params import SamplingParams
from posttrain.errors import PosttrainError
from posttrain.quant.inference import check_inference_quant, quantize_for_inference

ChatMessages = Sequence[dict[str, Any]]
Prompt = str | ChatMessages | Sequence[int]

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "StreamDelta"]


class LLM:
    """A rollout engine over one model module. `model`: a name or path for `load_model`, or a live
    `Transformer` (the engine holds it and never copies its weights: optimizer steps are seen at once;
    call `weights_updated()` after each one). Extra keyword arguments are EngineConfig fields, e.g.
    `compute_dtype="bfloat16"` (bf16 compute over fp32 weights; the default `auto` picks it where the CPU is fast
    in bf16). `dtype` is the dtype of the weights a name or path loads in; dtype="float32" also means fp32 compute
    unless compute_dtype says otherwise. `quant="int8"`: int8 weight-only decode of a model loaded by name or path
    (posttrain/quant/inference.py).
    `speculative={"method": "ngram", "num_tokens": 4}`: speculative decoding. `draft_model`: a loaded draft model module
    for `speculative={"method": "draft"}` (else it is loaded from `speculative.draft_model`)."""

    def __init__(
        self,
        model: str | Path | torch.nn.Module = "smollm2-135m",
        tokenizer: Any = None,
        *,
        config: EngineConfig | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        chat_template: str | None = None,
        quant: str | None = None,
        draft_model: torch.nn.Module | None = None,
        **config_fields: Any,
    ) -> None:
        check_inference_quant(quant)
        if isinstance(model, (str, Path)):
            from posttrain.models.hub import load_model

            model, loaded_tokenizer = load_model(model, dtype=dtype, device=device, chat_template=chat_template)
            model = quantize_for_inference(model, quant)
            tokenizer = tokenizer or loaded_tokenizer
        elif quant is not None:
            raise PosttrainError(
                f"quant={quant!r} applies to a model LLM loads itself (a name or path), for inference only; a live "
                "module (a trainer's) keeps its float weights"
            )
        elif chat_template is not None:
            raise PosttrainError("chat_template= applies to a model loaded by name or path; set it on the tokenizer")
        elif not isinstance(model, torch.nn.Module):
            raise PosttrainError(f"model must be a name, a path or a model module, got {type(model).__name__}")
        if config is not None and config_fields:
            raise PosttrainError(f"pass either config= or EngineConfig fields ({', '.join(config_fields)}), not both")
        if config is None:
            if dtype in ("float32", torch.float32):
                config_fields.setdefault("compute_dtype", "float32")
            try:
                config = EngineConfig(**config_fields)
            except TypeError as error:  # an unknown field name
                raise PosttrainError(f"LLM: {error}") from None
        self.tokenizer = tokenizer
        self.engine = LLMEngine(model, tokenizer, config, draft_model=draft_model)
        self._request_ids = itertools.count()
        self._finished: dict[str, RequestOutput] = {}  # outputs of submitted requests another `collect` stepped

    # ---- prompts ---------------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) for a string, a chat (list of messages) or token ids."""
        if isinstance(prompt, str):
            return prompt, self._need_tokenizer("a text prompt").encode(prompt, add_special_tokens=True)
        if isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
            tokenizer = self._need_tokenizer("a chat prompt")
            return None, list(tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True))
        if isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
            return None, prompt.tolist()
        raise PosttrainError(
            f"a prompt must be a string, a list of chat messages or a list of token ids; got {prompt!r:.80}"
        )

    def _need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise PosttrainError(f"{what} needs a tokenizer: pass tokenizer= to LLM, or give token ids")
        return self.tokenizer

    @staticmethod
    def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        """One prompt or a list of them. A list of ints is one token prompt; a list of dicts one chat."""
        if isinstance(prompts, str) or isinstance(prompts, torch.Tensor):
            return [prompts]
        if isinstance(prompts, Sequence) and prompts and all(isinstance(p, (int, dict)) for p in prompts):
            return [prompts]
        return list(prompts)

    # ---- generation -------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs in the order of the prompts. `params`: one for all, or one each."""
        return self.collect(self.submit(prompts, params), use_tqdm=use_tqdm)

    def submit(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[str]:
        """Queue every prompt in the engine without stepping it (all checked first: a bad one queues none); the
        request ids, for `collect`. Requests submitted apart decode together in one batch once any caller steps."""
        batch = self._as_batch(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(batch)
        else:
            params_list = list(params)
            if len(params_list) != len(batch):
                raise PosttrainError(f"got {len(params_list)} SamplingParams for {len(batch)} prompts")
        encoded = [self.encode_prompt(p) for p in batch]
        ids = [f"gen-{next(self._request_ids)}" for _ in batch]
        for request_id, (_, token_ids), sp in zip(ids, encoded, params_list):  # refuse bad requests up front
            self.engine.check_request(request_id, token_ids, sp)
        for request_id, (text, token_ids), sp in zip(ids, encoded, params_list):
            self.engine.add_request(request_id, token_ids, sp, prompt=text)
        return ids

    def collect(
        self, ids: list[str], use_tqdm: bool = False, before_step: Callable[[], None] | None = None
    ) -> list[RequestOutput]:
        """Step the engine until the submitted requests `ids` have finished; their outputs, in the order of `ids`.
        Other requests in the engine decode along; their outputs are kept for their own `collect`. `before_step`
        runs before every engine step this call makes (it may submit more). An error aborts `ids`."""
        results = {i: self._finished.pop(i) for i in ids if i in self._finished}
        mine = set(ids)
        queued = [self.engine.requests[i].params for i in ids if i in self.engine.requests]
        scoring = all(sp.max_tokens == 0 for sp in queued)  # prefill only: the rate counts prompt tokens
        desc = "score" if scoring else f"generate ({sum(sp.n for sp in queued)} samples)"
        bar = _progress_bar(len(ids), desc) if use_tqdm else None
        if bar is not None:
            bar.update(len(results))
        tokens_before = self._tokens_done(scoring)
        try:
            with self.engine.runner.malloc_scope():
                while len(results) < len(ids):
                    if before_step is not None:
                        before_step()
                    for output in self.engine.step():
                        if output.request_id not in mine:
                            if output.finished:  # another caller's submitted request: kept for its collect
                                self._finished[output.request_id] = output
                            continue
                        results[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
                            tokens = self._tokens_done(scoring) - tokens_before
                            bar.set_postfix_str(f"tok/s={_rate(bar, tokens)}", refresh=False)
                    if not self.engine.has_unfinished_requests() and len(results) < len(ids):
                        raise RuntimeError("engine finished without completing every request")
        except BaseException:
            self.abort(ids)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[request_id] for request_id in ids]

    def abort(self, ids: list[str]) -> None:
        """Drop submitted requests: those still running are aborted, finished outputs not collected are discarded."""
        for request_id in ids:
            self.engine.abort_request(request_id)
            self._finished.pop(request_id, None)

    def _tokens_done(self, scoring: bool) -> int:
        return self.engine.num_processed_tokens if scoring else self.engine.num_generated_tokens

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Generate for one prompt, yielding what each sample adds as it is produced. Text that could
        still become a stop string is held back until it cannot (so a stop string never leaks)."""
        from posttrain.engine.stop import safe_text_len

        params = params or SamplingParams()
        text, token_ids = self.encode_prompt(prompt)
        request_id = f"stream-{next(self._request_ids)}"
        self.engine.add_request(request_id, token_ids, params, prompt=text, stream=True)
        sent_text = [0] * params.n
        sent_tokens = [0] * params.n
        done = [False] * params.n
        try:
            while not all(done):
                outputs = self.engine.step()
                for output in outputs:
                    if output.request_id != request_id:
                        if output.finished:  # a submitted request's: kept for its collect
                            self._finished[output.request_id] = output
                        continue
                    for out in output.outputs:
                        if done[out.index] or (not out.token_ids and not out.finished):
                            continue
                        visible = len(out.text) if out.finished else safe_text_len(out.text, params.stop)
                        new_ids = out.token_ids[sent_tokens[out.index] :]
                        delta = StreamDelta(
                            request_id=request_id,
                            index=out.index,
                            text=out.text[sent_text[out.index] : visible],
                            token_ids=new_ids,
                            logprobs=out.logprobs[sent_tokens[out.index] :] if out.logprobs is not None else None,
                            finish_reason=out.finish_reason,
                            stop_reason=out.stop_reason,
                            policy_version=out.policy_version,
                        )
                        sent_text[out.index] = max(sent_text[out.index], visible)
                        sent_tokens[out.index] = len(out.token_ids)
                        done[out.index] = out.finished
                        if delta.text or delta.token_ids or delta.finished:
                            yield delta
                if not self.engine.has_unfinished_requests() and not all(done):
                    raise RuntimeError("engine finished without completing the stream")
        finally:
            self.engine.abort_request(request_id)  # a no-op once finished; frees blocks if the caller stops early

    # ---- weights and memory -----------------------------------------------------------------------

    def weights_updated(self, keep_running_kv: bool = False) -> int:
        """Call after the module's weights change (an optimizer step, a LoRA merge): drops prefix-cache
        entries computed under the old weights and bumps `policy_version`. Returns the new version.
        Sequences still running (another thread generating) recompute their K/V under the new weights, or with
        `keep_running_kv=True` go on over the K/V they have (an in-flight update; see LLMEngine.weights_updated)."""
        return self.engine.weights_updated(keep_running_kv)

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def weights_lock(self) -> Any:
        """The lock every engine step holds (engine/weights_lock.py; `with llm.weights_lock:`, re-entrant): hold it while changing the weights from another
        thread, and call `weights_updated()` before releasing it, so no forward ever reads half-updated weights
        and the tokens drawn after it record the new version."""
        return self.engine.weights_lock

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the engine's forwards compute in (EngineConfig.compute_dtype resolved): the weights' own, or bf16
        over fp32 weights. The logits and logprobs it returns are fp32 either way."""
        return self.engine.compute_dtype

    def sleep(self) -> None:
        """Free the KV pool and the weight copies (e.g. while the trainer needs the memory)."""
        self.engine.sleep()

    def wake(self) -> None:
        """Allocate the KV pool again."""
        self.engine.wake()

    def stats(self) -> dict[str, float]:
        return self.engine.stats()


def _progress_bar(num_prompts: int, desc: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=num_prompts, desc=desc, unit="prompt", dynamic_ncols=True)


def _rate(bar: Any, tokens: int) -> str:
    elapsed = bar.format_dict.get("elapsed") or 0
    return f"{tokens / elapsed:.0f}" if elapsed else "-"
