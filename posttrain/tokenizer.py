"""Tokenizer and chat template, at the edge: text in, token ids out (the engine speaks ids only).

A thin layer over the `tokenizers` library (a `tokenizer.json`) plus a Jinja2 chat template rendered
the way Hugging Face renders it, so ids and prompt strings match `transformers` exactly without
importing it (importing transformers costs seconds; this module loads in milliseconds).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from posttrain.errors import CheckpointError, PosttrainError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

# Tokens that close a chat turn in common templates. When one is a special token and the chat
# template writes it, generation should stop there even if the tokenizer's eos is another token
# (e.g. a base model with eos <|endoftext|> and a ChatML template). llama.cpp applies the same rule.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|return|>")


class Tokenizer:
    """Text <-> ids, and chat messages -> prompt, matching `transformers.AutoTokenizer` on the same files."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = {
            name: token
            for name, token in zip(SPECIAL_TOKEN_NAMES, (bos_token, eos_token, unk_token, pad_token))
            if token is not None
        }
        self.extra_eos_token_ids = frozenset(extra_eos_token_ids)

    # ---- loading and saving -------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load an HF tokenizer directory: tokenizer.json + tokenizer_config.json (+ chat_template.jinja).

        Extra end-of-generation ids come from `generation_config.json` / `config.json` when their
        `eos_token_id` is a list (as in Llama 3 or Qwen 2.5 instruct checkpoints).
        """
        directory = Path(path)
        tokenizer_file = directory / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise CheckpointError(f"{directory}: no {TOKENIZER_FILE} (only fast tokenizers are supported)")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # tokenizers raises a bare Exception on bad JSON
            raise CheckpointError(f"{tokenizer_file}: cannot be read as a tokenizer ({error})") from error
        config = _read_json(directory / TOKENIZER_CONFIG_FILE)
        special_map = _read_json(directory / "special_tokens_map.json")
        tokens = {name: _token_content(config.get(name, special_map.get(name))) for name in SPECIAL_TOKEN_NAMES}
        template_file = directory / CHAT_TEMPLATE_FILE
        chat_template = (
            template_file.read_text(encoding="utf-8")
            if template_file.is_file()  # the .jinja file wins over the config entry, as in transformers
            else _default_template(config.get("chat_template"), directory)
        )
        extra_eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            eos = _read_json(directory / name).get("eos_token_id")
            extra_eos += eos if isinstance(eos, list) else []
        return cls(backend, chat_template=chat_template, extra_eos_token_ids=extra_eos, **tokens)

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and chat_template.jinja.

        `transformers.AutoTokenizer.from_pretrained(directory)` loads the result with the same ids and
        the same chat template. The template goes in both places: older transformers read only the config.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / TOKENIZER_FILE))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
            **self.special_tokens,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
            (directory / CHAT_TEMPLATE_FILE).write_text(self.chat_template, encoding="utf-8")
        (directory / TOKENIZER_CONFIG_FILE).write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )

    # ---- ids -----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (e.g. a BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [
            encoding.ids for encoding in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        ]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return self.backend.decode_batch([list(ids) for ids in batch], skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """Id of a token string (None if absent), or a list of them for a list of strings."""
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (transformers' `len(tokenizer)`, not its `.vocab_size`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id("unk_token")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: eos, the extra ids the checkpoint lists, and the chat template's
        end-of-turn token (see END_OF_TURN_TOKENS)."""
        ids = set(self.extra_eos_token_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        special_ids = {
            token.content: token_id
            for token_id, token in self.backend.get_added_tokens_decoder().items()
            if token.special
        }
        for token in END_OF_TURN_TOKENS:
            if token in special_ids and self.chat_template and token in self.chat_template:
                ids.add(special_ids[token])
        return frozenset(ids)

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    # ---- chat ----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int] | str:
        """Render `messages` with the chat template, as transformers does; ids (no extra BOS) or the string.

        Extra keyword arguments reach the template as variables (e.g. `enable_thinking=False`).
        """
        if self.chat_template is None:
            raise PosttrainError("this tokenizer has no chat template (tokenizer_config.json has no chat_template)")
        conversation = _validated_messages(messages)
        variables = {**self.special_tokens, **template_kwargs}  # caller's values override, as in HF
        try:
            text = compile_chat_template(self.chat_template).render(
                messages=conversation,
                tools=None if tools is None else [dict(tool) for tool in tools],
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as error:
            raise PosttrainError(f"chat template failed on these messages: {error}") from error
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _validated_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as plain dicts with None-valued keys dropped (as HF does), or PosttrainError naming the problem."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise PosttrainError(f"chat messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise PosttrainError("chat messages are empty")
    conversation = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise PosttrainError(
                f"chat message {index} must be a dict with 'role' and 'content', got {type(message).__name__}"
            )
        if not isinstance(message.get("role"), str):
            raise PosttrainError(f"chat message {index} has no string 'role'")
        content = message.get("content")
        if content is None and not message.get("tool_calls"):
            raise PosttrainError(f"chat message {index} (role {message['role']!r}) has no 'content'")
        if content is not None and not isinstance(content, (str, list)):
            raise PosttrainError(
                f"chat message {index}: 'content' must be a string or a list of parts, got {type(content).__name__}"
            )
        conversation.append({key: value for key, value in message.items() if value is not None})
    return conversation


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` as a pass-through block.

    HF templates use it to mark assistant tokens for loss masks; without the tag a template that has
    it would not even parse. We only need the text, so the block renders its body unchanged.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's version: no HTML escaping (Jinja's built-in escapes <, >, &), and the json.dumps options exposed
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled in the sandbox with the globals and filters HF templates expect."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise PosttrainError(f"chat template has a syntax error at line {error.lineno}: {error.message}") from error


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: invalid JSON ({error})") from error
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _default_template(value: Any, directory: Path) -> str | None:
    """`chat_template` is a string, or a list of {"name", "template"} of which "default" is the one used."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, Mapping)}
        if "default" in named:
            return named["default"]
    raise CheckpointError(
        f"{directory / TOKENIZER_CONFIG_FILE}: chat_template is neither a string nor a list with a 'default' entry"
    )
