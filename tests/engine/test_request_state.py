"""EngineRequest (posttrain/engine/request_state.py): a request's samples' texts as the engine tracks them, and the
RequestOutput it reports."""

from __future__ import annotations

from posttrain.engine import SamplingParams
from posttrain.engine.request_state import EngineRequest
from posttrain.engine.sequence import Sequence


class _Letters:
    """A tokenizer whose token t is the letter chr(97 + t); token 25 ('z') is special."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + t) for t in ids if not (skip_special_tokens and t == 25))


def _request(params: SamplingParams, stream: bool = False) -> tuple[EngineRequest, Sequence]:
    seq = Sequence("r", [0, 1], params, None, num_forks=params.n - 1)
    return EngineRequest("r", "ab", [0, 1], params, stream, [seq] + [None] * (params.n - 1)), seq


def test_text_is_tracked_only_for_stop_strings_or_streaming() -> None:
    plain, seq = _request(SamplingParams(max_tokens=4))
    assert plain.detokenizer(seq, _Letters()) is None
    streaming, seq = _request(SamplingParams(max_tokens=4), stream=True)
    detok = streaming.detokenizer(seq, _Letters())
    assert detok is not None and streaming.detokenizer(seq, _Letters()) is detok  # made once
    stopping, seq = _request(SamplingParams(max_tokens=4, stop=["x"]))
    assert stopping.detokenizer(seq, None) is None  # no tokenizer: no text


def test_a_late_detokenizer_catches_up_with_a_forks_first_token() -> None:
    request, seq = _request(SamplingParams(max_tokens=4), stream=True)
    seq.token_ids += [2, 3]  # c, d: the second arrives with the detokenizer's first call (a fork's first token)
    detok = request.detokenizer(seq, _Letters())
    assert detok.text == "c"
    detok.add(3)
    assert request.current_text(0) == "cd"


def test_final_text_decodes_untracked_samples_and_drops_a_stop_token() -> None:
    request, seq = _request(SamplingParams(max_tokens=4))
    seq.token_ids += [2, 3, 4]
    assert request.final_text(seq, _Letters(), drop_last=False) == "cde"
    assert request.final_text(seq, _Letters(), drop_last=True) == "cd"
    assert request.final_text(seq, None, drop_last=False) == ""
    request.texts[0] = "done"
    assert request.current_text(0) == "done"  # the final text wins over anything tracked


def test_output_reports_unforked_samples_empty_and_logprobs_only_when_asked() -> None:
    request, seq = _request(SamplingParams(n=2, max_tokens=4))
    seq.token_ids.append(5)
    seq.output_logprobs.append(-0.5)
    seq.output_policy_versions.append(3)
    out = request.output()
    assert not out.finished
    assert [o.token_ids for o in out.outputs] == [[5], []]
    assert out.outputs[0].logprobs is None and out.outputs[0].token_policy_versions == [3]
    asked, seq = _request(SamplingParams(max_tokens=4, logprobs=0))
    seq.token_ids.append(5)
    seq.output_logprobs.append(-0.5)
    assert asked.output().outputs[0].logprobs == [-0.5]
