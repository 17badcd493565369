"""`tool_choice` "required" or a named function, enforced: the reply is pre-filled with the call's opening markup
and each later token is drawn only among those that keep the text inside the call grammar (call_grammar.py).

    table = TokenTable(tokenizer)                                   # once per server: each token id's text
    prefill = grammar.forced_prefix()                               # appended to the prompt (prompt-side ids)
    params.logits_processors = [CallMask(grammar, table, eos_ids, max_tokens, prefill)]

The mask, per step of one sample: the grammar state after the prefill and the sample's text so far; the
candidate tokens are the `CANDIDATES` most likely, each kept when its text keeps the state in the grammar (an
end-of-sequence token only where the reply may end); every other token gets -inf. Only when none of them fits
is the whole vocabulary searched, for the FALLBACK most likely that do. So the draw is from the model's distribution over the grammar's tokens among
its most likely (tokens far down the list, which a trained model gives a tiny mass, are not considered), and the
reported logprob is that masked distribution's (what the token was drawn from).

Budget: a token is allowed only if the tokens left after it (max_tokens minus those drawn) still cover the
shortest end of the call from there (call_grammar's closer, one token per character at worst, plus the
end-of-sequence token); once they come down to it, only tokens that begin that end are. So a reply whose
max_tokens covers the prefilled call's shortest form (`{}}` + `</tool_call>`, about 16 tokens with a name to
choose) always ends with whole calls and "stop".
"""

from __future__ import annotations

import torch

from posttrain.serve.call_grammar import CallGrammar, State

CANDIDATES = 64
FALLBACK = 8  # when none of the CANDIDATES fits: the most likely tokens that do, found in the whole vocabulary


class TokenTable:
    """Each token id's text (special tokens: empty, never allowed inside a call), decoded once."""

    def __init__(self, tokenizer: object) -> None:
        ids = [[i] for i in range(tokenizer.vocab_size)]
        self.texts: list[str] = tokenizer.batch_decode(ids, skip_special_tokens=True)
        # ids by their text's first two characters, when the first is ASCII ("" second: a one-character text)
        heads: dict[str, dict[str, list[int]]] = {}
        others: list[int] = []  # texts beginning with a non-ASCII character
        for token, text in enumerate(self.texts):
            if text and text[0].isascii():
                heads.setdefault(text[0], {}).setdefault(text[1:2], []).append(token)
            elif text:
                others.append(token)
        self.heads = {c: {d: torch.tensor(ids) for d, ids in seconds.items()} for c, seconds in heads.items()}
        self.others = torch.tensor(others, dtype=torch.long)

    def starting_with(self, grammar: CallGrammar, state: State) -> torch.Tensor:
        """The ids whose first two characters keep `state` in the grammar (a test per distinct ASCII pair; any
        non-ASCII character is taken where the grammar takes one)."""
        parts = [self.others] if grammar.takes_any_char(state) else []
        for first, seconds in self.heads.items():
            after = grammar.advance(state, first)
            if after is None:
                continue
            for second, ids in seconds.items():
                if second == "" or (
                    grammar.advance(after, second) if second.isascii() else grammar.takes_any_char(after)
                ):
                    parts.append(ids)
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


class CallMask:
    """A logits processor (SamplingParams.logits_processors) for one request: its samples' states are keyed by
    their output so far, so the n samples of one request share it."""

    def __init__(
        self, grammar: CallGrammar, table: TokenTable, eos_token_ids: set[int], max_tokens: int, prefill: str
    ) -> None:
        self.grammar = grammar
        self.table = table
        self.texts = table.texts
        self.eos = set(eos_token_ids)
        self.max_tokens = max_tokens
        start = grammar.advance(grammar.start, prefill)
        if start is None:
            raise ValueError(f"the prefill {prefill!r} is not in the call grammar")
        self._states: dict[tuple[int, ...], State] = {(): start}

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        state = self._state(output_token_ids)
        closer = self.grammar.closer(state)
        left = self.max_tokens - len(output_token_ids)
        if left <= len(closer) + 1:  # the budget: only the shortest end now
            allowed = self._closing(closer)
        else:
            top = torch.topk(logits, min(CANDIDATES, logits.numel())).indices.tolist()
            allowed = self._fitting(state, top, left)
            if not allowed:  # the whole vocabulary, narrowed to the tokens whose first character fits
                heads = self.table.starting_with(self.grammar, state)
                ranked = heads[torch.argsort(logits[heads], descending=True)].tolist()
                allowed = self._fitting(state, ranked + sorted(self.eos), left, most=FALLBACK)
        index = torch.tensor(allowed, dtype=torch.long, device=logits.device)
        masked = torch.full_like(logits, float("-inf"))
        masked[index] = logits[index]
        return masked

    def _state(self, ids: list[int]) -> State:
        key = tuple(ids)
        state = self._states.get(key)
        if state is None:
            state = self.grammar.advance(self._state(ids[:-1]), self.texts[ids[-1]])
            if state is None:  # cannot happen: every drawn token was allowed
                raise RuntimeError(f"token {ids[-1]} left the tool-call grammar")
            self._states[key] = state
        return state

    def _fitting(self, state: State, ids: list[int], left: int, most: int | None = None) -> list[int]:
        """The tokens of `ids` (in order, at most `most`) that keep the text in the grammar and leave, of the
        `left` tokens, enough for the shortest end afterwards."""
        allowed = []
        ends = self.grammar.accepts(state)
        for token in ids:
            if token in self.eos:
                fits = ends
            else:
                text = self.texts[token]
                after = self.grammar.advance(state, text) if text else None
                fits = after is not None and len(self.grammar.closer(after)) + 1 <= left - 1
            if fits:
                allowed.append(token)
                if len(allowed) == most:
                    break
        return allowed

    def _closing(self, closer: str) -> list[int]:
        if not closer:
            return sorted(self.eos)
        return [token for token, text in enumerate(self.texts) if text and closer.startswith(text)]
