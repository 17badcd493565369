"""The HTTP routes: /v1/models, /v1/completions, /v1/chat/completions, /health, /debug/stats.

    app = build_app(async_engine, tokenizer, max_body_bytes=4 << 20, api_keys=["sk-..."], tool_calling=None)
    uvicorn.run(app, host="127.0.0.1", port=8000)

With `api_keys`, every route but /health needs `Authorization: Bearer <key>` (auth.py). Tool calls in chat
replies are read with `tool_calling` (tools.py; default: the hermes parser).

Every refusal is an OpenAI-shaped error (errors.py) and leaves the server as it was. A client that goes
away has its requests aborted: streaming responses are cancelled by the server on disconnect, and
non-streaming handlers poll for the disconnect while they wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from posttrain.errors import PosttrainError
from posttrain.serve import render, tools
from posttrain.serve.async_engine import AsyncEngine, EngineDeadError, ServedModel
from posttrain.serve.auth import APIKeyAuth
from posttrain.serve.errors import APIError, context_length_exceeded, error_body, model_not_found
from posttrain.serve.forced_calls import CallMask, TokenTable
from posttrain.serve.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    dump,
)

DEFAULT_MAX_BODY_BYTES = 4 << 20
DISCONNECT_POLL_S = 0.1


def build_app(
    async_engine: AsyncEngine,
    tokenizer: Any,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    api_keys: Sequence[str] = (),
    tool_calling: tools.ToolCalling | None = None,
) -> FastAPI:
    """A FastAPI app over a (not yet started) AsyncEngine; the app starts and stops its loop. With `api_keys`,
    requests need one of them as a Bearer token (all routes but /health). `tool_calling`: how chat replies
    are read for tool calls (default: tools.tool_calling("hermes"))."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="posttrain", lifespan=lifespan)
    if api_keys:
        app.add_middleware(APIKeyAuth, keys=list(api_keys))
    api = _Handlers(async_engine, tokenizer, max_body_bytes, tool_calling or tools.tool_calling())
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(error.detail), type=kind), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse(
            error_body(f"internal error: {type(error).__name__}: {error}", type="internal_error"), status_code=500
        )

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_alive:
            return JSONResponse(error_body("the engine loop is not running", type="internal_error"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/debug/stats")
    async def debug_stats() -> dict[str, Any]:
        return async_engine.stats()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        cards = [
            ModelCard(
                id=m.name, created=created, root=m.parent or m.name, parent=m.parent, max_model_len=m.max_model_len
            )
            for m in async_engine.models.values()
        ]
        return dump(ModelList(data=cards))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await api.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await api.chat(request)

    return app


class _Handlers:
    def __init__(
        self, async_engine: AsyncEngine, tokenizer: Any, max_body_bytes: int, tool_calling: tools.ToolCalling
    ) -> None:
        self.engine = async_engine
        self.tokenizer = tokenizer
        self.max_body_bytes = max_body_bytes
        self.token_text = render.TokenText(tokenizer)
        self.tool_calling = tool_calling
        self.template_takes_tools = tools.template_takes_tools(getattr(tokenizer, "chat_template", None))
        self._tokens: TokenTable | None = None

    def _token_table(self) -> TokenTable:
        """Every token's text, decoded on the first forced tool call (about 0.1 s for 50k tokens)."""
        if self._tokens is None:
            self._tokens = TokenTable(self.tokenizer)
        return self._tokens

    # ---- shared steps ---------------------------------------------------------------------------------

    async def _parse(self, request: Request, schema: type[BaseModel]) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _too_large(self.max_body_bytes)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:  # RecursionError: deep nesting
            raise APIError(f"We could not parse the JSON body of your request: {error}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(f"The request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
        try:
            return schema.model_validate(data)
        except ValidationError as error:
            first = max(error.errors(), key=lambda e: len(e["loc"]))  # the most specific (union members)
            param = _param_name(first["loc"])
            raise APIError(
                f"{param or 'body'}: {first['msg']} (got {first.get('input')!r:.100})", param=param or None
            ) from None

    def _model(self, name: str) -> ServedModel:
        served = self.engine.models.get(name)
        if served is None:
            raise model_not_found(name, list(self.engine.models))
        return served

    def _check(self, served: ServedModel, request_id: str, prompts: list[list[int]], params: Any, param: str) -> None:
        for ids in prompts:
            if not ids:
                raise APIError(f"The {param} is empty", param=param)
            if len(ids) + params.max_tokens > served.max_model_len:
                raise context_length_exceeded(served.max_model_len, len(ids), params.max_tokens, param)
            try:
                self.engine.check(served.name, request_id, ids, params)
            except PosttrainError as error:
                raise APIError(str(error), param=param) from None

    @staticmethod
    async def _collect(request: Request, stream: AsyncIterator[tuple[int, Any]]) -> dict[int, Any] | None:
        """Final output per prompt index; None if the client disconnected first (its requests are aborted)."""
        finals: dict[int, Any] = {}

        async def consume() -> None:
            async with contextlib.aclosing(stream):
                async for index, output in stream:
                    if output.finished:
                        finals[index] = output

        task = asyncio.ensure_future(consume())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    task.result()
                    return finals
                if await request.is_disconnected():
                    return None
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    # ---- /v1/completions ---------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = await self._parse(request, CompletionRequest)
        served = self._model(req.model)
        if req.suffix:
            raise APIError("suffix is not supported", param="suffix")
        _check_echo(req)
        _check_prompt_logprobs(req)
        prompts, texts = self._encode_prompts(req.prompt)
        # The engine scores the prompt only when the response shows it: echo with logprobs (k = req.logprobs,
        # so a prompt position's top_logprobs are as many as a generated one's), or vLLM's prompt_logprobs;
        # with both, the larger k, and each part of the response takes its own.
        asked = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
        params = render.sampling_params(
            req,
            req.max_tokens if req.max_tokens is not None else 16,
            req.logprobs,
            max(asked) if asked else None,
            prompt_ranks=req.prompt_logprobs is not None,
        )
        request_id = f"cmpl-{uuid.uuid4().hex}"
        self._check(served, request_id, prompts, params, "prompt")
        outputs = self.engine.generate(served.name, request_id, prompts, params, texts, stream=req.stream)
        prompt_tokens = sum(len(ids) for ids in prompts)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(self._completion_stream(req, request_id, outputs, params, prompt_tokens, include_usage))
        finals = await self._collect(request, outputs)
        if finals is None:
            return Response(status_code=499)
        choices, completion_tokens = [], 0
        for index in sorted(finals):
            echoed = self._echo_text(prompts[index], texts[index]) if req.echo else ""
            for out in finals[index].outputs:
                completion_tokens += len(out.token_ids)
                choices.append(
                    CompletionChoice(
                        index=index * req.n + out.index,
                        text=echoed + out.text,
                        logprobs=self._choice_logprobs(req, finals[index], out, echoed),
                        finish_reason=render.finish_reason(out.finish_reason),
                        prompt_logprobs=self._prompt_logprobs(req, finals[index]),
                        prompt_token_ids=list(finals[index].prompt_token_ids) if req.return_token_ids else None,
                        token_ids=list(out.token_ids) if req.return_token_ids else None,
                    )
                )
        usage = render.usage(prompt_tokens, completion_tokens)
        return JSONResponse(
            _response_body(CompletionResponse, request_id, int(time.time()), served.name, choices, usage=usage)
        )

    def _choice_logprobs(self, req: CompletionRequest, request: Any, out: Any, echoed: str) -> Any:
        if req.logprobs is None:
            return None
        if req.echo:
            return render.echo_logprobs(self.token_text, request, echoed, out, num_top=req.logprobs)
        return render.completion_logprobs(
            self.token_text, out.token_ids, out.logprobs or [], out.top_logprobs if req.logprobs else None
        )

    def _prompt_logprobs(self, req: CompletionRequest | ChatCompletionRequest, request: Any) -> Any:
        if req.prompt_logprobs is None:
            return None
        return render.prompt_logprobs(self.token_text, request, req.prompt_logprobs)

    def _echo_text(self, ids: list[int], text: str | None) -> str:
        """The prompt as the client sent it; token ids are decoded as they are, special tokens included
        (they are part of what was scored)."""
        return text if text is not None else self.tokenizer.decode(ids, skip_special_tokens=False)

    def _encode_prompts(self, prompt: Any) -> tuple[list[list[int]], list[str | None]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError("The prompt is empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)], [None]
        if all(isinstance(p, str) for p in prompt):
            return [self.tokenizer.encode(p, add_special_tokens=True) for p in prompt], list(prompt)
        return [list(p) for p in prompt], [None] * len(prompt)

    async def _completion_stream(
        self,
        req: CompletionRequest,
        request_id: str,
        outputs: AsyncIterator,
        params: Any,
        prompt_tokens: int,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        trackers: dict[tuple[int, int], render.DeltaTracker] = {}
        completion_tokens = 0
        async with contextlib.aclosing(outputs):
            try:
                async for index, output in outputs:
                    for out in output.outputs:
                        first = (index, out.index) not in trackers
                        tracker = trackers.setdefault((index, out.index), render.DeltaTracker(params.stop))
                        delta = tracker.update(out)
                        if delta is None:
                            if first:
                                del trackers[(index, out.index)]  # its first chunk is still to come
                            continue
                        completion_tokens += len(delta.token_ids)
                        logprobs = None
                        if req.logprobs is not None:
                            logprobs = render.completion_logprobs(
                                self.token_text,
                                delta.token_ids,
                                delta.logprobs or [],
                                delta.top_logprobs if req.logprobs else None,
                                delta.text_offset,
                            )
                        choice = CompletionChoice(
                            index=index * req.n + out.index,
                            text=delta.text,
                            logprobs=logprobs,
                            finish_reason=delta.finish_reason,
                            prompt_token_ids=list(output.prompt_token_ids) if req.return_token_ids and first else None,
                            token_ids=delta.token_ids if req.return_token_ids else None,
                        )
                        yield render.sse(_response_body(CompletionResponse, request_id, created, req.model, [choice]))
            except (EngineDeadError, PosttrainError) as error:
                yield render.sse(error_body(str(error), type="internal_error"))
        if include_usage:
            usage = render.usage(prompt_tokens, completion_tokens)
            yield render.sse(_response_body(CompletionResponse, request_id, created, req.model, [], usage=usage))
        yield render.SSE_DONE

    # ---- /v1/chat/completions ----------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        req: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        served = self._model(req.model)
        plan = tools.request_tools(req, self.template_takes_tools, self.tool_calling)
        # a forced call's opening markup goes after the generation prompt: prompt-side ids, not sampled
        prompt = self._chat_prompt(req, plan) + (self.tokenizer.encode(plan.prefill) if plan.prefill else [])
        max_tokens = req.max_completion_tokens or req.max_tokens or max(1, served.max_model_len - len(prompt))
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        logprobs = (req.top_logprobs or True) if req.logprobs else None
        _check_prompt_logprobs(req)
        params = render.sampling_params(
            req, max_tokens, logprobs, req.prompt_logprobs, prompt_ranks=req.prompt_logprobs is not None
        )
        if plan.forced is not None:
            mask = CallMask(plan.forced, self._token_table(), served.eos_token_ids, max_tokens, plan.prefill)
            params.logits_processors = [mask]
        elif plan.parse and not plan.parallel and self.tool_calling.markup is not None:
            params.stop = [*params.stop, self.tool_calling.markup[1]]  # at most one call: end at its close
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        self._check(served, request_id, [prompt], params, "messages")
        outputs = self.engine.generate(served.name, request_id, [prompt], params, stream=req.stream)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(self._chat_stream(req, request_id, outputs, params, prompt, include_usage, plan))
        finals = await self._collect(request, outputs)
        if finals is None:
            return Response(status_code=499)
        choices, completion_tokens = [], 0
        for out in finals[0].outputs:
            completion_tokens += len(out.token_ids)
            logprobs = None
            if req.logprobs:
                logprobs = render.chat_logprobs(self.token_text, out.token_ids, out.logprobs or [], out.top_logprobs)
            message, finish_reason = tools.chat_reply(
                self.tool_calling, plan, plan.prefill + out.text, render.finish_reason(out.finish_reason)
            )
            choices.append(
                ChatChoice(
                    index=out.index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    token_ids=list(out.token_ids) if req.return_token_ids else None,
                )
            )
        body = _response_body(
            ChatCompletionResponse,
            request_id,
            int(time.time()),
            served.name,
            choices,
            usage=render.usage(len(prompt), completion_tokens),
            prompt_logprobs=self._prompt_logprobs(req, finals[0]),
            prompt_token_ids=list(finals[0].prompt_token_ids) if req.return_token_ids else None,
        )
        return JSONResponse(body)

    def _chat_prompt(self, req: ChatCompletionRequest, plan: tools.RequestTools) -> list[int]:
        messages = tools.template_messages(req.messages)
        extra = {"tools": plan.schemas} if plan.schemas else {}
        try:
            return list(
                self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
            )
        except PosttrainError as error:
            raise APIError(str(error), param="messages") from None

    async def _chat_stream(
        self,
        req: ChatCompletionRequest,
        request_id: str,
        outputs: AsyncIterator,
        params: Any,
        prompt: list[int],
        include_usage: bool,
        plan: tools.RequestTools,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())

        def chunk(choices: list[ChatChunkChoice], usage: Any = None, prompt_token_ids: Any = None) -> bytes:
            body = _response_body(
                ChatCompletionChunk,
                request_id,
                created,
                req.model,
                choices,
                usage=usage,
                prompt_token_ids=prompt_token_ids,
            )
            return render.sse(body)

        trackers = [render.DeltaTracker(params.stop) for _ in range(req.n)]
        readers = [tools.ToolCallReader(self.tool_calling, plan) for _ in range(req.n)] if plan.parse else None
        for reader in readers or []:
            reader.feed(plan.prefill, finished=False)  # held: the open call it begins
        completion_tokens = 0
        async with contextlib.aclosing(outputs):
            yield chunk(
                [ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(req.n)],
                prompt_token_ids=list(prompt) if req.return_token_ids else None,
            )
            try:
                async for _, output in outputs:
                    for out in output.outputs:
                        delta = trackers[out.index].update(out)
                        if delta is None:
                            continue
                        completion_tokens += len(delta.token_ids)
                        logprobs = None
                        if req.logprobs:
                            logprobs = render.chat_logprobs(
                                self.token_text, delta.token_ids, delta.logprobs or [], delta.top_logprobs
                            )
                        message, finish_reason = DeltaMessage(content=delta.text), delta.finish_reason
                        if readers is not None:
                            reader = readers[out.index]
                            content, calls = reader.feed(delta.text, finished=finish_reason is not None)
                            message = DeltaMessage(
                                content=content if content or not calls else None, tool_calls=calls or None
                            )
                            finish_reason = tools.finish_reason(finish_reason, reader.num_calls, plan)
                        yield chunk(
                            [
                                ChatChunkChoice(
                                    index=out.index,
                                    delta=message,
                                    logprobs=logprobs,
                                    finish_reason=finish_reason,
                                    token_ids=delta.token_ids if req.return_token_ids else None,
                                )
                            ]
                        )
            except (EngineDeadError, PosttrainError) as error:
                yield render.sse(error_body(str(error), type="internal_error"))
        if include_usage:
            yield chunk([], render.usage(len(prompt), completion_tokens))
        yield render.SSE_DONE


def _check_echo(req: CompletionRequest) -> None:
    """The combinations echo allows. max_tokens=0 without echo would return nothing at all, so it is refused,
    as vLLM does; echo in a stream is refused rather than half-done (the prompt's logprobs arrive only with
    the whole prefill, and a stream's first chunk would have to carry them per choice)."""
    if req.max_tokens == 0 and not req.echo:
        raise APIError(
            "max_tokens must be at least 1 unless echo is true (max_tokens=0 with echo scores the prompt only)",
            param="max_tokens",
        )
    if req.echo and req.stream:
        raise APIError("echo is not supported with stream=true; send the request without stream", param="echo")


def _check_prompt_logprobs(req: CompletionRequest | ChatCompletionRequest) -> None:
    """prompt_logprobs come whole with the final response; in a stream they are refused rather than dropped."""
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(
            "prompt_logprobs is not supported with stream=true; send the request without stream",
            param="prompt_logprobs",
        )


def _response_body(
    kind: type[BaseModel], request_id: str, created: int, model: str, choices: list[Any], **fields: Any
) -> dict[str, Any]:
    """A completion response or stream chunk of the class `kind`, as the JSON object it is sent as."""
    return dump(kind(id=request_id, created=created, model=model, choices=choices, **fields))


def _sse(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _param_name(loc: tuple) -> str:
    """A pydantic error location as OpenAI names parameters: ("messages", 0, "role") -> "messages.[0].role".
    Union members appear in the location under their type ("str", "list[int]"); they are left out."""
    parts = []
    for part in loc:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif (
            "[" not in part
            and part not in ("str", "int", "float", "bool")
            and not part.startswith("function-")
            and not part[:1].isupper()  # a union member's model class (NamedToolChoice)
        ):
            parts.append(part)
    return ".".join(parts)


def _too_large(limit: int) -> APIError:
    return APIError(f"The request body exceeds the limit of {limit} bytes", 413, code="request_too_large")
