"""Per-token policy versions (asynchronous RL's in-flight weight updates): every generated token records the
version of the weights that drew it, also when the weights change while its sequence runs (from another thread,
between engine steps under `LLM.weights_lock`), and no prefix-cache block computed under older weights is served."""

from __future__ import annotations

import threading

import torch

from posttrain.engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.tiny import tiny_model


def _engine(model) -> LLMEngine:
    # one token a step: these tests put updates between particular tokens (chained steps: test_chained_steps.py)
    config = EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=32, decode_steps=1)
    return LLMEngine(model, None, config)


def test_each_token_records_the_version_that_drew_it() -> None:
    model = tiny_model()
    engine = _engine(model)
    prompt = list(range(1, 10))
    engine.add_request("r", prompt, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))
    drawn_under: list[int] = []  # the version in force at each step that drew a token
    outputs = []
    step = 0
    while engine.has_unfinished_requests():
        version = engine.policy_version
        before = engine.num_generated_tokens
        outputs += engine.step()
        if engine.num_generated_tokens > before:
            drawn_under.append(version)
        step += 1
        if step in (3, 5):  # two updates while the samples run
            with torch.no_grad():
                model.lm_head.weight.mul_(0.9)
            engine.weights_updated()
    (output,) = outputs
    for sample in output.outputs:
        assert len(sample.token_policy_versions) == len(sample.token_ids) == 8
        assert sample.token_policy_versions == drawn_under[: len(sample.token_ids)]
        assert sample.policy_version == sample.token_policy_versions[0] == 0
    assert set(drawn_under) == {0, 1, 2}


def test_a_concurrent_update_lands_between_engine_steps() -> None:
    """A trainer thread updates the weights while this thread steps the engine: each update happens under the
    engine's weights lock, so every token's recorded version is the one whose weights computed it (checked by
    recording, inside the forward, which version the weights were at)."""
    model = tiny_model()
    engine = _engine(model)
    seen: list[tuple[int, int]] = []  # (the engine's version, the weights' version) at each forward
    weights_version = [0]

    def hook(module, args):
        seen.append((engine.policy_version, weights_version[0]))

    model.lm_head.register_forward_pre_hook(hook)
    stop = threading.Event()

    def trainer() -> None:
        while not stop.is_set():
            with engine.weights_lock:
                with torch.no_grad():
                    model.lm_head.weight.mul_(0.999)
                weights_version[0] += 1
                engine.weights_updated()

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        engine.add_request(
            "r", list(range(1, 10)), SamplingParams(temperature=1.0, seed=1, max_tokens=24, ignore_eos=True)
        )
        while engine.has_unfinished_requests():
            outputs = engine.step()
    finally:
        stop.set()
        thread.join()
    assert all(engine_v == weights_v for engine_v, weights_v in seen)
    versions = outputs[0].outputs[0].token_policy_versions
    assert versions == sorted(versions) and len(versions) == 24


def test_no_prefix_block_from_older_weights_is_served() -> None:
    model = tiny_model()
    engine = _engine(model)
    prompt = list(range(1, 18))  # four full blocks
    params = SamplingParams(temperature=0, max_tokens=2)

    def run(request_id: str):
        engine.add_request(request_id, prompt, params)
        out = []
        while engine.has_unfinished_requests():
            out += engine.step()
        return out[0]

    run("a")
    assert run("b").num_cached_tokens > 0  # same weights: the cache serves the prompt
    engine.weights_updated()
    assert run("c").num_cached_tokens == 0  # new version: nothing computed before it
    assert run("d").num_cached_tokens > 0  # blocks computed under the new version are served again


# ---- in-flight updates that keep the running sequences' K/V (weights_updated(keep_running_kv=True))


def _run_to_end(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_keep_running_kv_decodes_on_without_recomputing() -> None:
    model = tiny_model()
    prompt = list(range(1, 10))
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, logprobs=0)
    runs = {}
    for keep in (None, True, False):  # None: no update at all
        engine = _engine(model)
        engine.add_request("r", prompt, params)
        for _ in range(3):
            engine.step()
        if keep is not None:
            engine.weights_updated(keep_running_kv=keep)  # the weights did not change: only the K/V path differs
        (output,) = _run_to_end(engine)
        runs[keep] = (output.outputs[0], engine.scheduler.num_preemptions, engine.num_processed_tokens)
    plain, kept, recomputed = runs[None], runs[True], runs[False]
    # Kept: nothing recomputed, the same forwards as without the update, so the very same tokens and logprobs.
    assert kept[1] == 0 and kept[2] == plain[2] == len(prompt) + 7
    assert kept[0].token_ids == plain[0].token_ids and kept[0].logprobs == plain[0].logprobs
    assert kept[0].token_policy_versions == [0, 0, 0, 1, 1, 1, 1, 1]
    # Recomputed: the sequence went back and prefilled its prompt and its 3 tokens again.
    assert recomputed[1] == 1 and recomputed[2] == plain[2] + len(prompt) + 2


def test_a_sequence_that_kept_old_kv_never_publishes_blocks() -> None:
    """a runs across an update keeping its K/V; c (fresh, after the update) computes the shared prompt's blocks
    again. b asks for a's whole text: it may be served c's fresh blocks, never the ones a filled after the update
    on top of K/V from the old weights (their hashes chain from the same prompt, so a published block would hit)."""
    model = tiny_model()
    engine = _engine(model)
    prompt = list(range(1, 18))  # 4 full blocks + 1 token
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()  # a's prefill (and its first token)
    with torch.no_grad():
        model.layers[0].self_attn.k_proj.weight.mul_(-1)
    engine.weights_updated(keep_running_kv=True)
    engine.add_request("c", prompt, SamplingParams(temperature=0, max_tokens=1))
    outputs = {out.request_id: out for out in _run_to_end(engine)}
    text = prompt + list(outputs["a"].outputs[0].token_ids)  # 25 tokens: 6 full blocks
    engine.add_request("b", text, SamplingParams(temperature=0, max_tokens=1))
    (b,) = _run_to_end(engine)
    assert b.num_cached_tokens == 16  # c's 4 prompt blocks; a's blocks 5 and 6 are not in the cache
    assert engine.num_free_blocks == engine.num_blocks
