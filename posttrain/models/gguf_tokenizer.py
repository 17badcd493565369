"""Build a `Tokenizer` from the `tokenizer.*` metadata of a GGUF file.

A GGUF has no tokenizer.json. For a byte-level BPE vocabulary (`tokenizer.ggml.model = "gpt2"`) it
stores the tokens (already in the GPT-2 byte alphabet, e.g. "Ġthe"), the merges ("Ġ t"), a type per
token (3 = control, 4 = user-defined) and a pre-tokenizer *name* (`tokenizer.ggml.pre`). The name
stands for the regexes llama.cpp splits text with before BPE; `PRE_TOKENIZERS` turns each name we
know into the `tokenizers` pipeline that splits text the same way as the model's original
tokenizer.json.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from posttrain.errors import CheckpointError
from posttrain.tokenizer import Tokenizer

CONTROL_TOKEN = 3  # llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
USER_DEFINED_TOKEN = 4

# The pre-tokenizer split regexes of the original tokenizer.json files.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How one llama.cpp `pre` name splits text: a pre-tokenizer, an optional normalizer, BPE options."""

    pre_tokenizer: Callable[[], pre_tokenizers.PreTokenizer]
    normalizer: Callable[[], normalizers.Normalizer] | None = None
    # Llama 3 looks a whole pre-token up in the vocabulary before merging (llama.cpp does the same).
    ignore_merges: bool = False


def _gpt2_byte_level() -> pre_tokenizers.PreTokenizer:
    # ByteLevel's built-in regex is GPT-2's: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # StarCoder / SmolLM: every digit is its own piece ("12345" -> 1,2,3,4,5), then GPT-2's regex.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_byte_level()])


def _split_then_bytes(regex: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )

    return build


PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "gpt2": PreTokenizerSpec(_gpt2_byte_level),
    # llama.cpp's fallback name when its converter did not recognise the tokenizer; GPT-2's regex is
    # the best guess (transformers makes the same one).
    "default": PreTokenizerSpec(_gpt2_byte_level),
    "smollm": PreTokenizerSpec(_digits_then_gpt2),
    "starcoder": PreTokenizerSpec(_digits_then_gpt2),
    "llama-bpe": PreTokenizerSpec(_split_then_bytes(LLAMA3_SPLIT), ignore_merges=True),
    "llama3": PreTokenizerSpec(_split_then_bytes(LLAMA3_SPLIT), ignore_merges=True),
    "qwen2": PreTokenizerSpec(_split_then_bytes(QWEN2_SPLIT), normalizer=normalizers.NFC),
    "deepseek-r1-qwen": PreTokenizerSpec(_split_then_bytes(QWEN2_SPLIT), normalizer=normalizers.NFC),
}


def tokenizer_from_gguf(tokenizer_meta: Mapping[str, Any], source: str = "GGUF file") -> Tokenizer:
    """A `Tokenizer` from a GGUF's `tokenizer.*` metadata (`GGUFCheckpoint.tokenizer_meta`).

    `source` names the file in error messages.
    """
    model = tokenizer_meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        hint = " (SentencePiece vocabularies are not supported yet)" if model == "llama" else ""
        raise CheckpointError(f"{source}: unsupported tokenizer.ggml.model {model!r}{hint}; supported: gpt2")
    tokens: list[str] = _require(tokenizer_meta, "tokenizer.ggml.tokens", source)
    merges: list[str] = _require(tokenizer_meta, "tokenizer.ggml.merges", source)
    pre = tokenizer_meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"{source}: unsupported tokenizer.ggml.pre {pre!r}; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    spec = PRE_TOKENIZERS[pre]

    backend = BackendTokenizer(
        models.BPE(
            vocab=_vocab(tokens),
            merges=[_merge_pair(merge, index, source) for index, merge in enumerate(merges)],
            ignore_merges=spec.ignore_merges,
            byte_fallback=False,
            fuse_unk=False,
        )
    )
    backend.normalizer = spec.normalizer() if spec.normalizer else None
    backend.pre_tokenizer = spec.pre_tokenizer()
    backend.decoder = decoders.ByteLevel()

    token_types = tokenizer_meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    # Control tokens (<|im_start|>) are special: matched whole, dropped by skip_special_tokens.
    # User-defined ones (<think>) are matched whole too but are ordinary text.
    backend.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, token_types)
            if kind == CONTROL_TOKEN
        ]
    )
    backend.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in zip(tokens, token_types)
            if kind == USER_DEFINED_TOKEN
        ]
    )

    def token_of(key: str) -> str | None:
        token_id = tokenizer_meta.get(f"tokenizer.ggml.{key}")
        if token_id is None:
            return None
        if not 0 <= token_id < len(tokens):
            raise CheckpointError(f"{source}: tokenizer.ggml.{key} = {token_id} is outside the vocabulary")
        return tokens[token_id]

    bos_token, eos_token = token_of("bos_token_id"), token_of("eos_token_id")
    backend.post_processor = _post_processor(
        bos_token if tokenizer_meta.get("tokenizer.ggml.add_bos_token", False) else None,
        eos_token if tokenizer_meta.get("tokenizer.ggml.add_eos_token", False) else None,
        backend,
    )
    end_of_turn = [
        tokenizer_meta[key]
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if key in tokenizer_meta
    ]
    return Tokenizer(
        backend,
        chat_template=tokenizer_meta.get("tokenizer.chat_template"),
        bos_token=bos_token,
        eos_token=eos_token,
        pad_token=token_of("padding_token_id"),
        unk_token=token_of("unknown_token_id"),
        extra_eos_token_ids=end_of_turn,
    )


def _vocab(tokens: list[str]) -> dict[str, int]:
    """Token -> id. A token listed twice keeps its first id (BPE needs unique strings)."""
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)
    return vocab


def _merge_pair(merge: str, index: int, source: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right or " " in right:
        raise CheckpointError(f"{source}: tokenizer.ggml.merges[{index}] = {merge!r} is not two tokens")
    return left, right


def _post_processor(bos: str | None, eos: str | None, backend: BackendTokenizer) -> processors.PostProcessor:
    """What `encode(..., add_special_tokens=True)` adds: BOS/EOS as `tokenizer.ggml.add_*_token` say.

    Same layout as transformers builds: single = [bos] A [eos], pair = [bos] A [eos] [bos] B [eos].
    """

    def template(sequence: str, type_id: int) -> list[str]:
        return [f"{token}:{type_id}" for token in (bos, sequence, eos) if token]

    special = [(token, backend.token_to_id(token)) for token in dict.fromkeys(t for t in (bos, eos) if t)]
    return processors.TemplateProcessing(
        single=template("$A", 0), pair=template("$A", 0) + template("$B", 1), special_tokens=special
    )


def _require(tokenizer_meta: Mapping[str, Any], key: str, source: str) -> Any:
    if key not in tokenizer_meta:
        raise CheckpointError(f"{source}: missing required metadata key {key}")
    return tokenizer_meta[key]
