"""Tool calls on /v1/chat/completions, as vLLM's `--tool-call-parser` serves them (docs/serve.md "Tool calls").

    calling = tool_calling("hermes")                      # at startup: the parser and its markup
    plan = request_tools(req, template_takes_tools(src), calling)  # per request: tools, what to parse and force
    messages = template_messages(req.messages)            # OpenAI messages -> chat-template messages
    message, reason = chat_reply(calling, plan, plan.prefill + out.text, out_reason)  # a whole reply
    reader = ToolCallReader(calling, plan)                # a streamed reply, per choice (fed the prefill first):
    content, call_deltas = reader.feed(delta_text, finished)

Request side: `tools` reach the chat template's `tools=` variable; assistant `tool_calls` (arguments as the
JSON string OpenAI sends) are decoded into objects for the template, `tool` messages keep `tool_call_id`.

Response side: the model's text is read with the same parsers the rollout uses (posttrain.envs.tool_calls).
With a known markup (hermes: `<tool_call>` ... `</tool_call>`) each block is parsed on its own as soon as it
closes: a block that parses is one call, one that does not stays in the content verbatim, and whitespace
next to a call is dropped. A stream and a non-stream reply therefore agree exactly, and text that could still
become markup is held back, so no partial markup reaches the content. A parser given as `file.py:function`
has no known markup: its choice's text is held until the end and parsed whole.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import jinja2.meta

from posttrain.envs.tool_calls import ToolCallParser, get_tool_call_parser
from posttrain.envs.turns import ToolCall
from posttrain.serve.call_grammar import CallGrammar
from posttrain.serve.errors import APIError
from posttrain.serve.protocol import (
    CHAT_ROLES,
    AssistantMessage,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    ToolCallDelta,
    ToolCallOut,
)
from posttrain.tokenizer import compile_chat_template

# The text around one call, per built-in parser name: where a stream can tell content from a call.
TOOL_CALL_MARKUP: dict[str, tuple[str, str]] = {"hermes": ("<tool_call>", "</tool_call>")}


@dataclass(frozen=True)
class ToolCalling:
    """The server's tool-call setup (`--tool-call-parser`): the parser and, when known, its markup."""

    parser: ToolCallParser
    markup: tuple[str, str] | None


def tool_calling(spec: str = "hermes") -> ToolCalling:
    """A registered parser name or `path/to/file.py:function`; PosttrainError for an unknown one."""
    return ToolCalling(get_tool_call_parser(spec), TOOL_CALL_MARKUP.get(spec))


def template_takes_tools(source: str | None) -> bool:
    """Whether the chat template reads the `tools` variable at all (a template that does not would drop them)."""
    if not source:
        return False
    environment = compile_chat_template(source).environment
    return "tools" in jinja2.meta.find_undeclared_variables(environment.parse(source))


@dataclass(frozen=True)
class RequestTools:
    """What one request asks: the tools for the template (None: none), whether to parse the reply for calls,
    the one function a named `tool_choice` forces (its reply ends with "stop", as OpenAI's does), the grammar
    that forces calls ("required" or named; forced_calls.py), and whether a reply may hold several calls."""

    schemas: list[dict[str, Any]] | None = None
    parse: bool = False
    named: str | None = None
    forced: CallGrammar | None = None
    parallel: bool = True

    @property
    def prefill(self) -> str:
        """The text the reply is begun with (prompt side: the model did not sample it)."""
        return self.forced.forced_prefix() if self.forced is not None else ""


def request_tools(req: ChatCompletionRequest, takes_tools: bool, calling: ToolCalling) -> RequestTools:
    choice = req.tool_choice
    named = choice.function.name if choice is not None and not isinstance(choice, str) else None
    if not req.tools:
        if choice == "required" or named is not None:
            raise APIError(f"tool_choice {choice if named is None else named!r} needs tools", param="tool_choice")
        return RequestTools()
    if not takes_tools:
        raise APIError(
            "tools: this model's chat template does not render tools; serve it with a template that does "
            "(posttrain serve --chat-template chatml_tools, or a .jinja path)",
            param="tools",
        )
    names = [tool.function.name for tool in req.tools]
    repeated = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if repeated is not None:
        raise APIError(f"tools: the function name {repeated!r} is given twice", param="tools")
    if named is not None and named not in names:
        raise APIError(
            f"tool_choice names the function {named!r}, which is not among tools ({', '.join(names)})",
            param="tool_choice",
        )
    forced = None
    if choice == "required" or named is not None:
        if calling.markup != TOOL_CALL_MARKUP["hermes"]:
            raise APIError(
                f"tool_choice {choice if named is None else named!r} is enforced with the hermes call markup; "
                "serve with --tool-call-parser hermes",
                param="tool_choice",
            )
        forced = CallGrammar([named] if named is not None else names, parallel=req.parallel_tool_calls)
    schemas = [tool.model_dump(exclude_none=True) for tool in req.tools]
    return RequestTools(
        schemas=schemas, parse=choice != "none", named=named, forced=forced, parallel=req.parallel_tool_calls
    )


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages as a chat template reads them: `developer` as `system`, text parts joined,
    assistant tool calls with their arguments as objects, tool results with their `tool_call_id`."""
    if not messages:
        raise APIError("messages must contain at least one message", param="messages")
    rendered = []
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise APIError(
                f"Invalid value {message.role!r} for messages[{i}].role; supported roles: {', '.join(CHAT_ROLES)}",
                param=f"messages.[{i}].role",
            )
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        entry: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
        entry["content"] = content or ""
        if message.tool_calls:
            if message.role != "assistant":
                raise APIError(f"messages[{i}]: only assistant messages carry tool_calls", param=f"messages.[{i}]")
            entry["tool_calls"] = [
                _template_call(call, f"messages.[{i}].tool_calls.[{j}]") for j, call in enumerate(message.tool_calls)
            ]
        if message.role == "tool":
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            if message.name is not None:
                entry["name"] = message.name
        rendered.append(entry)
    return rendered


def _template_call(call: Any, param: str) -> dict[str, Any]:
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            raise APIError(
                f"{param}.function.arguments is not valid JSON ({error.msg} at character {error.pos})",
                param=f"{param}.function.arguments",
            ) from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


# ---- reading the reply ---------------------------------------------------------------------------------


def new_call_id() -> str:
    """Unique across requests, as OpenAI's are: an agent's conversation collects ids from many replies."""
    return f"call_{uuid.uuid4().hex[:24]}"


def wire_function(call: ToolCall) -> FunctionCall:
    """A parsed call's function in OpenAI's wire format: arguments as a JSON string."""
    return FunctionCall(name=call.name, arguments=json.dumps(call.arguments, ensure_ascii=False))


def chat_reply(
    calling: ToolCalling, plan: RequestTools, text: str, reason: str | None
) -> tuple[AssistantMessage, str | None]:
    """A whole reply's message and finish reason; without parsing, the text as content."""
    if not plan.parse:
        return AssistantMessage(content=text), reason
    content, calls = ToolCallReader(calling, plan).update(text, finished=True)
    if not calls:
        return AssistantMessage(content=content), reason
    tool_calls = [ToolCallOut(id=call.id, function=wire_function(call)) for call in calls]
    return AssistantMessage(content=content or None, tool_calls=tool_calls), finish_reason(reason, len(calls), plan)


class _Content:
    """The content text around calls: whitespace that touches a call is dropped, the rest passes through;
    trailing whitespace is held until it is known not to precede a call."""

    def __init__(self) -> None:
        self._held = ""
        self._after_call = False

    def add(self, piece: str) -> str:
        if self._after_call:
            piece = piece.lstrip()
            self._after_call = not piece
        body = piece.rstrip()
        if not body:
            self._held += piece
            return ""
        shown, self._held = self._held + body, piece[len(body) :]
        return shown

    def call(self) -> None:
        self._held, self._after_call = "", True

    def flush(self) -> str:
        shown, self._held = self._held, ""
        return shown


class ToolCallReader:
    """One choice's reply, fed its text so far: returns the content that may be shown now and the calls that
    completed. Fed once with `finished=True` it reads a whole reply (non-streaming); fed as the text grows it
    gives the same content and calls in pieces."""

    def __init__(self, calling: ToolCalling, plan: RequestTools | None = None) -> None:
        self._max_calls = 1 if plan is not None and not plan.parallel else None  # parallel_tool_calls false
        self._parser = calling.parser
        self._markup = calling.markup
        self._content = _Content()
        self._read = 0  # characters of the text consumed
        self._text = ""  # what feed() has received
        self.num_calls = 0

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        """A stream's step: the text it added; returns the content to show and the calls that completed."""
        self._text += delta
        first = self.num_calls
        content, calls = self.update(self._text, finished)
        deltas = [ToolCallDelta(index=first + k, id=c.id, function=wire_function(c)) for k, c in enumerate(calls)]
        return content, deltas

    def update(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        if self._markup is None:
            return self._whole(text) if finished else ("", [])
        start, end = self._markup
        shown: list[str] = []
        calls: list[ToolCall] = []
        while True:
            at = text.find(start, self._read)
            if at < 0:
                safe = len(text) if finished else len(text) - _partial_marker(text, start, self._read)
                shown.append(self._content.add(text[self._read : safe]))
                self._read = safe
                break
            shown.append(self._content.add(text[self._read : at]))
            close = text.find(end, at + len(start))
            if close < 0 and not finished:  # a call still being written: hold it
                self._read = at
                break
            stop = len(text) if close < 0 else close + len(end)  # a last call left open is read too
            block, self._read = text[at:stop], stop
            call = self._one_call(block)
            if call is None:
                shown.append(self._content.add(block))
            else:
                calls.append(call)
                self._content.call()
        if finished:
            shown.append(self._content.flush())
        return "".join(shown), self._counted(calls)

    def _counted(self, calls: list[ToolCall]) -> list[ToolCall]:
        """The calls within the reply's limit (parallel_tool_calls false: the first), counted."""
        if self._max_calls is not None:
            calls = calls[: max(0, self._max_calls - self.num_calls)]
        self.num_calls += len(calls)
        return calls

    def _one_call(self, block: str) -> ToolCall | None:
        turn = self._parser(block)
        if len(turn.tool_calls) != 1 or turn.errors:
            return None
        call = turn.tool_calls[0]
        return ToolCall(name=call.name, arguments=call.arguments, id=new_call_id())

    def _whole(self, text: str) -> tuple[str, list[ToolCall]]:
        turn = self._parser(text)
        if not turn.tool_calls:
            return text, []
        calls = [ToolCall(name=c.name, arguments=c.arguments, id=new_call_id()) for c in turn.tool_calls]
        return turn.content, self._counted(calls)


def _partial_marker(text: str, marker: str, lo: int) -> int:
    """The length of the longest end of text[lo:] that begins `marker` (text to hold back: it may become one)."""
    for size in range(min(len(marker) - 1, len(text) - lo), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def finish_reason(reason: str | None, num_calls: int, plan: RequestTools) -> str | None:
    """OpenAI's: "tool_calls" when a reply that stopped made calls ("stop" under a named tool_choice);
    a reply cut by max_tokens stays "length"."""
    if reason == "stop" and num_calls and plan.named is None:
        return "tool_calls"
    return reason
