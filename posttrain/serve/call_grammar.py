"""The text of a reply made of Hermes tool calls, as a character machine: what `tool_choice` "required" or a named
function lets the model write (forced_calls.py masks the tokens that would leave it).

    grammar = CallGrammar(["calculator", "lookup"], parallel=True)
    state = grammar.advance(grammar.start, '<tool_call>\\n{"name": "calc')   # None: the text left the grammar
    grammar.accepts(state), grammar.closer(state)                             # may it end here; the shortest end

A reply is one call (and nothing after it), or with `parallel` one or more separated by whitespace:

    <tool_call>\\n{"name": "<one of names>", "arguments": <JSON object>} ws </tool_call>

(whitespace allowed before the `}` and the `</tool_call>`, as the model may write them). The arguments are any
JSON object (RFC 8259: strings with their escapes and no raw control characters, numbers, true / false / null,
nesting); `\\u` escapes of the surrogate block (D800-DFFF, first hex digit d) are refused, since a lone surrogate
cannot be sent as UTF-8. Every text the machine accepts parses with the hermes parser into that many calls.

Whitespace outside strings comes in runs of at most MAX_WHITESPACE characters.

A state is a hashable tuple (phase, mode, stack, rest, whitespace run): `stack` holds the containers open in the
arguments ('o' object, 'a' array; the arguments object is the first), `rest` the chars a literal still needs.
"""

from __future__ import annotations

import json
import re

WS = " \t\n\r"
OPEN = '<tool_call>\n{"name": "'
NAME_END = '", "arguments": '
END_TAG = "</tool_call>"
_HEX = "0123456789abcdefABCDEF"
_ESCAPES = '"\\/bfnrt'
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_CLOSE = {"o": "}", "a": "]"}
_STRING_STOPS = re.compile(r'["\\\x00-\x1f]')  # what ends a string, escapes, or is refused in one
MAX_WHITESPACE = 16  # characters in a row outside strings (a model left free may write nothing else)
_NUMBER_ENDS = {"#0", "#d", "#f", "#x"}  # a number may end in these modes

# phases of one call, then DONE between calls
P_OPEN, P_NAME, P_ARGS, P_BRACE, P_TAG, P_DONE = range(6)

State = tuple  # (phase, mode, stack, rest, whitespace run)


class CallGrammar:
    """Calls to `names`; one call, or with `parallel` several."""

    def __init__(self, names: list[str], parallel: bool) -> None:
        self.options = [json.dumps(name, ensure_ascii=False)[1:-1] + NAME_END for name in names]
        self.parallel = parallel
        self.start: State = (P_OPEN, "", "", OPEN, 0)

    def forced_prefix(self) -> str:
        """The text every reply begins with: the opening markup, and the name when there is only one."""
        return OPEN + (self.options[0] if len(self.options) == 1 else "")

    def advance(self, state: State | None, text: str) -> State | None:
        if state is not None and state[0] == P_ARGS and state[1] in ("str", "key") and not _STRING_STOPS.search(text):
            return state  # plain string content (most of a call's text): nothing changes
        for char in text:
            if state is None:
                return None
            state = self._step(state, char)
        return state

    def takes_any_char(self, state: State) -> bool:
        """Whether a non-ASCII character may come next: inside a string (or a name that has one next, read
        loosely: any non-ASCII name lets them all be tried)."""
        in_string = state[0] == P_ARGS and state[1] in ("str", "key")
        return in_string or (state[0] == P_NAME and any(not o.isascii() for o in self.options))

    def accepts(self, state: State | None) -> bool:
        return state is not None and state[0] == P_DONE

    # ---- one character -------------------------------------------------------------------------------

    def _step(self, state: State, c: str) -> State | None:
        moved = self._move(state[:4], c)
        if moved is None:
            return None
        if c in WS and not (moved[0] == P_ARGS and moved[1] in ("str", "key")):
            run = state[4] + 1  # whitespace between tokens of the call: a bounded run
            return None if run > MAX_WHITESPACE else (*moved, run)
        return (*moved, 0)

    def _move(self, state: tuple, c: str) -> tuple | None:
        phase, mode, stack, rest = state
        if phase == P_OPEN:
            if rest == OPEN and c in WS:
                return state
            if c != rest[0]:
                return None
            rest = rest[1:]
            return (P_OPEN, "", "", rest) if rest else (P_NAME, "", "", "")
        if phase == P_NAME:
            typed = mode + c
            if typed in self.options:
                return (P_ARGS, "start", "", "")
            return (P_NAME, typed, "", "") if any(o.startswith(typed) for o in self.options) else None
        if phase == P_ARGS:
            return self._json(mode, stack, rest, c)
        if phase == P_BRACE:
            if c in WS:
                return state
            return (P_TAG, "", "", END_TAG) if c == "}" else None
        if phase == P_TAG:
            if rest == END_TAG and c in WS:
                return state
            if c != rest[0]:
                return None
            rest = rest[1:]
            return (P_TAG, "", "", rest) if rest else (P_DONE, "", "", "")
        # P_DONE: with parallel, whitespace and another call; without, the reply ends here
        if not self.parallel:
            return None
        if c in WS:
            return state
        return (P_OPEN, "", "", OPEN[1:]) if c == OPEN[0] else None

    def _json(self, mode: str, stack: str, rest: str, c: str) -> State | None:
        def at(new_mode: str, new_stack: str = stack, new_rest: str = "") -> State:
            return (P_ARGS, new_mode, new_stack, new_rest)

        def closed(new_stack: str) -> State:  # a container closed: the arguments object itself ends the call
            return (P_BRACE, "", "", "") if not new_stack else at("after", new_stack)

        if mode in ("str", "key"):  # inside a string (a value's or a key's)
            if c == '"':
                return at("colon") if mode == "key" else at("after")
            if c == "\\":
                return at(mode + "\\")
            return None if ord(c) < 0x20 else at(mode)
        if mode.endswith("\\"):  # after a backslash
            base = mode[:-1]
            if c == "u":
                return at(base + "u", new_rest="4")
            return at(base) if c in _ESCAPES else None
        if mode.endswith("u"):  # a \\u escape's hex digits; rest: how many are left
            if c not in _HEX or (rest == "4" and c in "dD"):
                return None
            left = int(rest) - 1
            return at(mode[:-1]) if left == 0 else at(mode, new_rest=str(left))
        if mode == "lit":
            return (at("lit", new_rest=rest[1:]) if rest[1:] else at("after")) if c == rest[0] else None
        if mode.startswith("#"):
            number = _number_step(mode, c)
            if number is not None:
                return at(number)
            if mode not in _NUMBER_ENDS:
                return None
            mode = "after"  # the number ended: c is read after it
        if c in WS:
            return at(mode)
        if mode == "start":
            return at("first_key", "o") if c == "{" else None
        if mode in ("first_key", "next_key"):
            if c == '"':
                return at("key")
            return closed(stack[:-1]) if c == "}" and mode == "first_key" else None
        if mode == "colon":
            return at("value") if c == ":" else None
        if mode == "after":
            top = stack[-1]
            if c == ",":
                return at("next_key" if top == "o" else "value")
            return closed(stack[:-1]) if c == _CLOSE[top] else None
        # "value" (after ':' or ',' in an array) or "first_value" (after '[', which may close at once)
        if c == "]" and mode == "first_value":
            return closed(stack[:-1])
        return _value_start(stack, c)

    # ---- the shortest way to end -----------------------------------------------------------------------

    def closer(self, state: State) -> str:
        """The shortest text that takes `state` to the end of a call (where the reply may end)."""
        phase, mode, stack, rest, _ = state
        tail = "}" + END_TAG
        if phase == P_OPEN:
            return rest + min(self.options, key=len) + "{}" + tail
        if phase == P_NAME:
            return min((o for o in self.options if o.startswith(mode)), key=len)[len(mode) :] + "{}" + tail
        if phase == P_BRACE:
            return tail
        if phase == P_TAG:
            return rest
        if phase == P_DONE:
            return ""
        close_all = "".join(_CLOSE[c] for c in reversed(stack)) + tail
        if mode == "start":
            return "{}" + tail
        if mode in ("str", "key", "str\\", "key\\", "stru", "keyu"):
            finish = {"\\": "n", "u": "0" * int(rest or 0)}.get(mode[-1], "") + '"'
            return finish + (":0" if mode.startswith("key") else "") + close_all
        if mode == "lit":
            return rest + close_all
        if mode.startswith("#"):
            return ("" if mode in _NUMBER_ENDS else "0") + close_all
        return {"next_key": '"":0', "colon": ":0", "value": "0"}.get(mode, "") + close_all


def _value_start(stack: str, c: str) -> State | None:
    def at(mode: str, new_stack: str = stack, rest: str = "") -> State:
        return (P_ARGS, mode, new_stack, rest)

    if c == '"':
        return at("str")
    if c == "{":
        return at("first_key", stack + "o")
    if c == "[":
        return at("first_value", stack + "a")
    if c == "-":
        return at("#-")
    if c == "0":
        return at("#0")
    if c.isascii() and c.isdigit():
        return at("#d")
    if c in _LITERALS:
        return at("lit", rest=_LITERALS[c])
    return None


def _number_step(mode: str, c: str) -> str | None:
    """A JSON number's next mode after c, or None when c does not continue it."""
    digit = c.isascii() and c.isdigit()
    if mode == "#-":
        return ("#0" if c == "0" else "#d") if digit else None
    if mode in ("#0", "#d"):
        if c == ".":
            return "#."
        if c in "eE":
            return "#e"
        return "#d" if digit and mode == "#d" else None
    if mode in ("#.", "#f"):
        if digit:
            return "#f"
        return "#e" if c in "eE" and mode == "#f" else None
    if mode == "#e":
        return "#s" if c in "+-" else ("#x" if digit else None)
    if mode in ("#s", "#x"):
        return "#x" if digit else None
    return None
