"""The CPU fast paged attention against the simple reference, and the paged model path against the dense one."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from posttrain import kernels
from posttrain.models.attention import PagedAttentionMetadata
from posttrain.models.config import ModelConfig
from posttrain.models.paged_attention import paged_attention, reference_paged_attention
from posttrain.models.transformer import Transformer
from tests.engine.kernel_builds import KERNEL_MARCHES, forget_kernels, use_kernels_built_for

BS, HKV, H, D = 4, 2, 6, 8


def _layout(rng: random.Random, num_blocks: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Block tables with the sharing the engine produces: groups of samples sharing prompt blocks,
    strangers sharing a first 'system prompt' block, singletons; mixed decode and prefill rows."""
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    system = free.pop()
    tables, ctx, qlens = [], [], []
    for kind in ["group", "single", "group", "prefill", "group", "single", "prefill", "group"]:
        prompt_blocks = [system] + [free.pop() for _ in range(rng.randint(0, 4))]
        members = rng.randint(2, 5) if kind == "group" else 1
        for _ in range(members):
            own = [free.pop() for _ in range(rng.randint(1, 3))]
            table = prompt_blocks + own
            length = (len(table) - 1) * BS + rng.randint(1, BS)
            tables.append(table)
            ctx.append(length)
            qlens.append(rng.randint(2, min(length, 9)) if kind == "prefill" else 1)
    return tables, ctx, qlens


@pytest.fixture(params=[*KERNEL_MARCHES, "pytorch"])
def fast_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each CPU fast path: the C kernels built for each instruction set (when they build and run here,
    tests/engine/conftest.py) and the PyTorch one."""
    if request.param == "pytorch":
        monkeypatch.setattr(kernels, "supports", lambda q, cache: False)
    else:
        use_kernels_built_for(request.param, monkeypatch)
    yield request.param
    forget_kernels()


@pytest.mark.parametrize("seed", range(6))
def test_fast_path_matches_reference(seed: int, fast_path: str) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = 120
    tables, ctx, qlens = _layout(rng, num_blocks)
    if seed % 3 == 0:  # pure decode steps exercise the cascade alone
        qlens = [1] * len(qlens)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    N = sum(qlens)
    slots = []
    for t, c, n in zip(tables, ctx, qlens):
        slots += [t[p // BS] * BS + p % BS for p in range(c - n, c)]
    q, k, v = torch.randn(N, H, D), torch.randn(N, HKV, D), torch.randn(N, HKV, D)
    cache = torch.randn(2, num_blocks, BS, HKV, D)
    outs = []
    for fn in (reference_paged_attention, paged_attention):
        meta = PagedAttentionMetadata(
            [cache.clone()], torch.tensor(slots), block_tables, torch.tensor(ctx), torch.tensor(qlens), max(qlens)
        )
        outs.append(fn(q, k, v, meta, 0))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def _tiny_model() -> Transformer:
    cfg = ModelConfig(
        model_type="llama",
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=64,
        head_dim=8,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return Transformer(cfg).eval()


def test_paged_model_path_matches_dense(fast_path: str) -> None:
    """Prefill two prompts in chunks, then decode samples that share the prompt blocks: the hidden states
    of every new token equal the dense causal forward over the same tokens."""
    model = _tiny_model()
    cfg = model.config
    caches = [torch.zeros(2, 40, BS, cfg.num_key_value_heads, cfg.head_dim) for _ in range(cfg.num_hidden_layers)]
    prompt = torch.randint(0, 64, (11,)).tolist()  # 2 full blocks + 3 tokens
    tails = [torch.randint(0, 64, (3,)).tolist() for _ in range(3)]  # three samples, 3 tokens each
    shared = [1, 2]  # full prompt blocks, shared by all samples
    own = [[3, 4], [5, 6], [7, 8]]  # each sample's copy of the partial prompt block, then one more
    with torch.inference_mode():

        def run(tokens_per_seq, starts, tables):
            ids, pos, slots, qlens, ctx = [], [], [], [], []
            for toks, start, table in zip(tokens_per_seq, starts, tables):
                ids += toks
                pos += range(start, start + len(toks))
                slots += [table[p // BS] * BS + p % BS for p in range(start, start + len(toks))]
                qlens.append(len(toks))
                ctx.append(start + len(toks))
            width = max(len(t) for t in tables)
            meta = PagedAttentionMetadata(
                caches,
                torch.tensor(slots),
                torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                torch.tensor(ctx),
                torch.tensor(qlens),
                max(qlens),
            )
            return model.hidden_states(torch.tensor(ids), positions=torch.tensor(pos), attn_meta=meta)

        # Prefill the prompt for sample 0 in two chunks; copy the partial block for the others.
        run([prompt[:6]], [0], [shared + own[0][:1]])
        run([prompt[6:]], [6], [shared + own[0][:1]])
        for cache in caches:
            cache[:, [own[1][0], own[2][0]]] = cache[:, [own[0][0]]]
        # Decode the three samples together, token by token.
        for step in range(3):
            hidden = run([[tails[s][step]] for s in range(3)], [11 + step] * 3, [shared + own[s] for s in range(3)])
            for s in range(3):
                dense = model.hidden_states(torch.tensor([prompt + tails[s][: step + 1]]))[0, -1]
                torch.testing.assert_close(hidden[s], dense, atol=1e-5, rtol=1e-5)


def test_staged_decode_matches_reference_across_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps of the PyTorch path that carry the gathered suffixes over (decode_staging): appends,
    block boundaries, a sequence leaving, suffixes outgrowing the staged room. Every step equals the
    reference, in two layers, and most steps only append."""
    monkeypatch.setattr(kernels, "supports", lambda q, cache: False)
    from posttrain.models.paged_plan import plan_for
    from posttrain.models.paged_workspace import PagedWorkspace

    torch.manual_seed(0)
    workspace = PagedWorkspace()  # the engine's runner keeps one across steps
    free = list(range(1, 200))
    prompt_len = 6  # one full block shared by a group's samples, then each sample's own blocks
    seqs = []
    for _ in range(2):
        shared = free.pop(0)
        for _ in range(3):
            seqs.append({"table": [shared, free.pop(0)], "len": prompt_len})
    fast = [torch.randn(2, 200, BS, HKV, D) for _ in range(2)]
    ref = [c.clone() for c in fast]
    extended = 0
    for step in range(40):
        if step == 15:
            seqs.pop(1)  # a sequence finishes: the next step gathers afresh
        for seq in seqs:
            if seq["len"] % BS == 0:
                seq["table"].append(free.pop(0))
            seq["len"] += 1
        width = max(len(s["table"]) for s in seqs)
        tables = torch.tensor([s["table"] + [0] * (width - len(s["table"])) for s in seqs])
        slots = torch.tensor([s["table"][(s["len"] - 1) // BS] * BS + (s["len"] - 1) % BS for s in seqs])
        ctx = torch.tensor([s["len"] for s in seqs])
        S = len(seqs)
        meta = PagedAttentionMetadata(fast, slots, tables, ctx, torch.ones(S, dtype=torch.long), 1, workspace)
        for layer in range(2):
            q, k, v = torch.randn(S, H, D), torch.randn(S, HKV, D), torch.randn(S, HKV, D)
            out = paged_attention(q, k, v, meta, layer)
            expected = reference_paged_attention(
                q, k, v, PagedAttentionMetadata(ref, slots, tables, ctx, torch.ones(S, dtype=torch.long), 1), layer
            )
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        plan = plan_for(meta, BS).decode
        assert plan.staging is not None
        extended += plan.staging.extends is not None
        if step in (0, 15):
            assert plan.staging.extends is None, step
    assert extended >= 30, extended  # rebuilt only at the start, after the leave, and when the room ran out
    workspace.release()
    assert workspace.staging.previous is None and not workspace.staging.buffers
