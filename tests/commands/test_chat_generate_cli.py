"""`posttrain generate` and `posttrain chat` on bad input: text that is not UTF-8 (refused with the input and
the byte, as the dataset readers do), and in chat a message too long for the model, which must not end the
session."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch

from posttrain.cli import main as cli_main
from posttrain.commands.generate import read_prompts_file
from posttrain.commands.text_input import decode_line, text_problem
from posttrain.engine.llm import LLM
from tests.data.tiny import save_tiny_model_dir

# argv as Python hands it over when the shell passed the bytes b"hi \xff\xfe there" (surrogateescape)
BAD_ARGV = b"hi \xff\xfe there".decode("utf-8", "surrogateescape")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")  # max_position_embeddings=512


def error_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_generate_refuses_a_prompt_argument_that_is_not_utf8(model_dir, capsys):
    assert cli_main(["generate", "--model", str(model_dir), "--max-tokens", "2", "--prompt", BAD_ARGV]) == 2
    assert error_lines(capsys) == ["error: --prompt: invalid UTF-8 (byte 0xff) at character 4"]
    assert cli_main(["generate", "--model", str(model_dir), "--prompt", "fine", "--prompt", BAD_ARGV]) == 2
    assert error_lines(capsys) == ["error: --prompt #2: invalid UTF-8 (byte 0xff) at character 4"]
    assert cli_main(["generate", "--model", str(model_dir), "--prompt", "fine", "--system", BAD_ARGV]) == 2
    assert error_lines(capsys) == ["error: --system: invalid UTF-8 (byte 0xff) at character 4"]


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("prompts.txt", b"fine\nbad \xff here\n", "2:5: invalid UTF-8 (byte 0xff)"),
        ("prompts.jsonl", b'{"prompt": "fine"}\n{"prompt": "bad \xff"}\n', "2:17: invalid UTF-8 (byte 0xff)"),
        # valid UTF-8 and valid JSON, but an unpaired surrogate escape is not text
        (
            "prompts.jsonl",
            b'{"prompt": "fine"}\n\n{"messages": [{"role": "user", "content": "a\\udcff"}]}\n',
            "3: messages: a string holds the lone surrogate U+DCFF, which is not text",
        ),
    ],
)
def test_generate_refuses_a_prompts_file_that_is_not_utf8(model_dir, tmp_path, capsys, name, content, expected):
    path = tmp_path / name
    path.write_bytes(content)
    assert cli_main(["generate", "--model", str(model_dir), "--max-tokens", "2", "--prompts-file", str(path)]) == 2
    assert error_lines(capsys) == [f"error: {path}:{expected}"]


def test_prompts_files_read_as_utf8(tmp_path):
    text = tmp_path / "p.txt"
    text.write_bytes("\ufeffgrüße\r\n\n  \nnaïve\n".encode())  # a byte-order mark, CRLF, blank lines
    assert read_prompts_file(text) == ["grüße", "naïve"]
    rows = tmp_path / "p.jsonl"
    rows.write_text('{"prompt": "\\ud83d\\ude00 ok"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert read_prompts_file(rows) == ["\U0001f600 ok", [{"role": "user", "content": "hi"}]]


def test_text_problems_name_the_byte_or_the_surrogate():
    assert text_problem("plain ünïcode") is None
    assert text_problem(BAD_ARGV) == (4, "invalid UTF-8 (byte 0xff)")
    assert text_problem("ab\ud800") == (3, "holds the lone surrogate U+D800, which is not text")
    assert decode_line(b"\xef\xbb\xbfhi\n", first_line=True) == ("hi\n", None)
    assert decode_line(b"h\xc3(", first_line=False) == ("", (2, "invalid UTF-8 (byte 0xc3)"))


class Chat:
    """Runs `posttrain chat` on the tiny model with `stdin_bytes` piped in; records each conversation sent."""

    def __init__(self, monkeypatch, model_dir: Path) -> None:
        self.sent: list[list[str]] = []
        self.answered: list[str] = []
        self.monkeypatch, self.model_dir = monkeypatch, model_dir
        stream = LLM.stream

        def recording_stream(llm, messages, params=None):
            self.sent.append([m["content"] for m in messages])
            yield from stream(llm, messages, params)
            self.answered.append(messages[-1]["content"])  # streamed to the end

        monkeypatch.setattr(LLM, "stream", recording_stream)

    def run(self, stdin_bytes: bytes, errors: str = "surrogateescape") -> int:
        # A C / C.UTF-8 locale gives stdin errors="surrogateescape"; other UTF-8 locales give "strict".
        self.monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin_bytes), "utf-8", errors))
        return cli_main(["chat", "--model", str(self.model_dir), "--max-tokens", "4", "--temperature", "0"])


@pytest.mark.parametrize("errors", ["surrogateescape", "strict"])
def test_chat_reports_a_line_that_is_not_utf8_and_goes_on(model_dir, monkeypatch, capsys, errors):
    chat = Chat(monkeypatch, model_dir)
    assert chat.run(b"Hi\nbad \xff\xfe line\nHello again\n", errors) == 0
    assert error_lines(capsys) == ["error: <stdin>:2:5: invalid UTF-8 (byte 0xff); the line is skipped"]
    assert chat.answered == ["Hi", "Hello again"]
    assert len(chat.sent[1]) == 3 and chat.sent[1][0] == "Hi" and chat.sent[1][2] == "Hello again"


def test_chat_survives_a_message_longer_than_the_context(model_dir, monkeypatch, capsys):
    chat = Chat(monkeypatch, model_dir)
    too_long = "hello " * 1000  # ~4000 tokens; the tiny model's context is 512
    assert chat.run(f"Hi\n{too_long}\nHello again\n".encode()) == 0
    err = error_lines(capsys)
    assert len(err) == 1 and err[0].startswith("error: ") and "max_model_len=512" in err[0], err
    assert "the conversation goes on" in err[0]
    assert chat.answered == ["Hi", "Hello again"]  # the third line got its answer
    assert [len(s) for s in chat.sent] == [1, 3, 3]
    assert chat.sent[2][0] == "Hi" and chat.sent[2][2] == "Hello again"  # the long one left no trace


def test_chat_refuses_a_system_argument_that_is_not_utf8(model_dir, capsys):
    assert cli_main(["chat", "--model", str(model_dir), "--system", BAD_ARGV]) == 2
    assert error_lines(capsys) == ["error: --system: invalid UTF-8 (byte 0xff) at character 4"]


@pytest.fixture
def made(monkeypatch) -> list[LLM]:
    """Every LLM the commands make, in order."""
    made: list[LLM] = []
    original = LLM.__init__

    def recording_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(LLM, "__init__", recording_init)
    return made


def test_generate_takes_the_engines_compute_dtype(model_dir, made, monkeypatch, capsys):
    """--compute-dtype reaches EngineConfig; --dtype float32 alone means fp32 compute; a value the weights cannot
    give is one line."""
    argv = ["generate", "--model", str(model_dir), "--max-tokens", "2", "--temperature", "0", "--prompt", "hi"]
    assert cli_main([*argv, "--compute-dtype", "bfloat16"]) == 0
    assert made[-1].compute_dtype == torch.bfloat16
    monkeypatch.setenv("POSTTRAIN_CPU_FEATURES", "avx512f avx512_bf16")  # auto would pick bf16 here
    assert cli_main([*argv, "--dtype", "float32"]) == 0
    assert made[-1].compute_dtype == torch.float32
    capsys.readouterr()
    assert cli_main([*argv, "--dtype", "bfloat16", "--compute-dtype", "float32"]) == 2
    assert error_lines(capsys) == [
        "error: compute_dtype='float32': the model's weights are bfloat16; the engine computes in the weights' "
        "dtype, or in bfloat16 over float32 weights"
    ]


def test_generate_with_speculative_decoding_prints_the_same_greedy_text(model_dir, tmp_path, capsys):
    """--speculative ngram, and --draft-model (a one-layer student written by `posttrain convert`): the greedy
    output of `generate --json` is the plain engine's."""
    base = ["generate", "--model", str(model_dir), "--prompt", "abcabcabc", "--max-tokens", "12", "--json"]
    assert cli_main(base) == 0
    expected = capsys.readouterr().out
    assert cli_main(base + ["--speculative", "ngram", "--num-speculative-tokens", "3"]) == 0
    assert capsys.readouterr().out == expected
    assert cli_main(base + ["--speculative", "ngram", "--fixed-drafts"]) == 0
    assert capsys.readouterr().out == expected
    student = tmp_path / "student"
    assert cli_main(["convert", "--model", str(model_dir), "--out", str(student), "--num-layers", "1"]) == 0
    capsys.readouterr()
    assert cli_main(base + ["--draft-model", str(student)]) == 0
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--num-speculative-tokens", "3"], "--num-speculative-tokens needs --speculative ngram|draft"),
        (["--speculative", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens=0: must be"),
        (["--speculative", "draft"], "--speculative draft needs --draft-model NAME|DIR"),
        (["--speculative", "ngram", "--draft-model", "x"], "--draft-model goes with --speculative draft"),
        (["--fixed-drafts"], "--fixed-drafts needs --speculative ngram|draft"),
    ],
)
def test_bad_speculative_flags_are_one_line(model_dir, capsys, flags, expected):
    assert cli_main(["generate", "--model", str(model_dir), "--prompt", "hi", *flags]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and expected in lines[0]


def test_generate_chains_decode_steps_as_asked_and_prints_the_same_text(model_dir, made, capsys):
    """--decode-steps reaches EngineConfig (1: one step at a time); the greedy output is the same either way; a bad
    value is one line."""
    base = ["generate", "--model", str(model_dir), "--prompt", "abcabcabc", "--max-tokens", "12", "--json"]
    assert cli_main([*base, "--decode-steps", "1"]) == 0
    assert made[-1].engine.config.decode_steps == 1 and made[-1].stats()["steps"] == 12  # the prefill and 11 steps
    expected = capsys.readouterr().out
    assert cli_main([*base, "--decode-steps", "4"]) == 0
    assert made[-1].engine.config.decode_steps == 4 and made[-1].stats()["steps"] == 1 + 3  # chains of 4, 4 and 3
    assert capsys.readouterr().out == expected
    assert cli_main([*base, "--decode-steps", "0"]) == 2
    assert error_lines(capsys) == ["error: decode_steps=0: must be a positive integer"]
