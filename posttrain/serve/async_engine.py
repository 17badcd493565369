"""AsyncEngine: one background thread drives the synchronous engines; asyncio handlers await outputs.

    served = [ServedModel("base", engine, adapter=None), ServedModel("math", engine2, adapter="math")]
    async_engine = AsyncEngine(served, select_adapter=lambda name: set_adapter(module, name))
    async_engine.start()
    async for prompt_index, output in async_engine.generate("base", "cmpl-1", [ids], params): ...

Handlers never touch an engine: they queue commands (add / abort) for the loop thread, which applies
them between steps, so each engine is used by one thread only. The loop thread hands every output to
the asyncio loop of the handler that asked (`call_soon_threadsafe`), into that call's queue.

LoRA: all served models share ONE module. Each served model has its own engine (its own KV pool and
prefix cache, so no adapter reads another's cached K/V) and names the adapter that must be active while
that engine steps. The loop steps the engines with work in turn and switches the active adapter before
each step (a flag per LoRA layer, no weight copy). Requests for different adapters therefore never share
a forward pass: mixed traffic is served time-sliced, which is the price of the shared-weights design.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from posttrain.engine.llm_engine import LLMEngine
from posttrain.engine.outputs import RequestOutput
from posttrain.engine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop stopped or a step failed; the request cannot finish."""


@dataclass
class ServedModel:
    name: str
    engine: LLMEngine
    adapter: str | None = None  # LoRA adapter active while this engine steps; None: the base weights
    parent: str | None = None  # the base model's served name, for an adapter

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def eos_token_ids(self) -> set[int]:
        return self.engine.eos_token_ids


@dataclass
class _Call:
    """One `generate` call: its prompts' request ids and where their outputs go."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    request_ids: list[str]
    unfinished: set[str] = field(default_factory=set)


class AsyncEngine:
    def __init__(self, models: list[ServedModel], select_adapter: Callable[[str | None], None] | None = None) -> None:
        if not models:
            raise ValueError("AsyncEngine needs at least one served model")
        self.models = {m.name: m for m in models}
        self._select_adapter = select_adapter
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._calls: dict[str, tuple[_Call, int]] = {}  # request id -> (its call, prompt index); loop thread only
        self._running: dict[str, set[str]] = {name: set() for name in self.models}  # loop thread only
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.num_aborted = 0
        self.num_failed_steps = 0

    # ---- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="posttrain-engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict[str, Any]:
        """Per served model: the engine's counters (free KV blocks among them) and its unfinished requests."""
        per_model = {}
        for name, served in self.models.items():
            stats = dict(served.engine.stats())
            stats["unfinished_requests"] = served.engine.num_unfinished_requests
            per_model[name] = stats
        return {"models": per_model, "aborted_requests": self.num_aborted, "failed_steps": self.num_failed_steps}

    # ---- requests (event-loop side) ---------------------------------------------------------------------

    def check(self, model: str, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise PosttrainError for a request the engine would refuse (reads only immutable engine state)."""
        self.models[model].engine.check_request(request_id, prompt_token_ids, params)

    async def generate(
        self,
        model: str,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        prompt_texts: list[str | None] | None = None,
        stream: bool = False,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every prompt with `params`; yield (prompt index, output) as the engine reports them: each
        prompt's final output, and with stream=True its cumulative output after every step. Leaving early
        (a disconnect cancels the consumer) aborts what is unfinished and frees its KV blocks."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        call = _Call(asyncio.get_running_loop(), asyncio.Queue(), ids, set(ids))
        texts = prompt_texts or [None] * len(prompts)
        self._send(
            ("add", model, call, [(rid, ids_, text) for rid, ids_, text in zip(ids, prompts, texts)], params, stream)
        )
        pending = set(ids)
        try:
            while pending:
                item = await call.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                index, output = item
                if output.finished:
                    pending.discard(output.request_id)
                yield index, output
        finally:
            if pending:
                self._send(("abort", model, sorted(pending)))

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- the loop (engine thread) -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._apply_commands()
            busy = [m for m in self.models.values() if m.engine.has_unfinished_requests()]
            if not busy:
                self._wake.wait()
                self._wake.clear()
                continue
            for served in busy:
                self._step(served)
        self._fail_everything(EngineDeadError("the server is shutting down"))

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, model, call, prompts, params, stream = command
                self._add(self.models[model], call, prompts, params, stream)
            else:
                _, model, request_ids = command
                engine = self.models[model].engine
                for request_id in request_ids:
                    if request_id in self._calls:
                        engine.abort_request(request_id)
                        self._forget(model, request_id)
                        self.num_aborted += 1

    def _add(self, served: ServedModel, call: _Call, prompts: list, params: SamplingParams, stream: bool) -> None:
        added = []
        try:
            for index, (request_id, token_ids, text) in enumerate(prompts):
                served.engine.add_request(request_id, token_ids, params, prompt=text, stream=stream)
                added.append(request_id)
                self._calls[request_id] = (call, index)
                self._running[served.name].add(request_id)
        except Exception as error:  # checked before queuing, so only a race could land here
            for request_id in added:
                served.engine.abort_request(request_id)
                self._forget(served.name, request_id)
            _deliver(call, error)

    def _step(self, served: ServedModel) -> None:
        try:
            if self._select_adapter is not None:
                self._select_adapter(served.adapter)
            outputs = served.engine.step()
        except Exception as error:  # a failed step must not take the server down: fail its requests
            self.num_failed_steps += 1
            for request_id in list(self._running[served.name]):
                call, _ = self._calls[request_id]
                served.engine.abort_request(request_id)
                self._forget(served.name, request_id)
                _deliver(call, EngineDeadError(f"generation failed: {type(error).__name__}: {error}"))
            return
        for output in outputs:
            entry = self._calls.get(output.request_id)
            if entry is None:
                continue
            call, index = entry
            if output.finished:
                self._forget(served.name, output.request_id)
            _deliver(call, (index, output))

    def _forget(self, model: str, request_id: str) -> None:
        self._calls.pop(request_id, None)
        self._running[model].discard(request_id)

    def _fail_everything(self, error: Exception) -> None:
        self._apply_commands()
        for name, request_ids in self._running.items():
            for request_id in list(request_ids):
                call, _ = self._calls[request_id]
                self.models[name].engine.abort_request(request_id)
                self._forget(name, request_id)
                _deliver(call, error)


def _deliver(call: _Call, item: Any) -> None:
    try:
        call.loop.call_soon_threadsafe(call.outputs.put_nowait, item)
    except RuntimeError:  # the caller's event loop is closed: nobody is waiting any more
        pass
