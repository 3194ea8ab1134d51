"""CUDA path (bf16/fp16): the paged engine against a dense forward of the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.llm import LLM
from engine.model.llama import DenseCausalAttention
from engine.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("which", ["plain_model", "hybrid_model"])
def test_cuda_engine_matches_dense_forward(request: pytest.FixtureRequest, which: str, dtype: str) -> None:
    path: Path = request.getfixturevalue(which)
    llm = LLM(str(path), device="cuda", dtype=dtype, max_num_batched_tokens=48)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (90, 20, 60)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, return_logits=True)
    outs = llm.generate(prompts, params) + llm.generate(prompts[:1], params)
    assert outs[-1].num_cached_tokens == 80
    model = llm.engine.model
    window = model.config.sliding_window
    for out in outs:
        gen = out.outputs[0]
        ids = out.prompt_token_ids + gen.token_ids
        if window is not None and len(ids) > window:
            continue  # the dense reference has no window; the hybrid model is checked on CPU
        with torch.inference_mode():
            t = torch.tensor(ids, device="cuda")
            hidden = model(t, torch.arange(len(ids), device="cuda"), DenseCausalAttention(1))
            ref = model.compute_logits(hidden).float().cpu()
        p = len(out.prompt_token_ids)
        torch.testing.assert_close(torch.stack(gen.logits), ref[p - 1 : p - 1 + 8], atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("which", ["plain_model", "hybrid_model"])
def test_cuda_graph_replay_matches_eager_steps(request: pytest.FixtureRequest, which: str) -> None:
    """Small steps replay captured graphs (engine.step_graphs); they must give what the eager
    runner gives: same greedy tokens, logits within bf16 noise, also after many replays."""
    path: Path = request.getfixturevalue(which)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (90, 20, 60, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, return_logits=True)
    runs = {}
    for eager in (True, False):
        llm = LLM(str(path), device="cuda", dtype="float32", max_num_batched_tokens=48, enforce_eager=eager)
        outs = llm.generate(prompts, params) + llm.generate(prompts[:2], params)
        graphs = llm.engine.runner.graphs
        if eager:
            assert graphs is None
        else:
            assert graphs is not None and graphs.captures > 0 and graphs.steps > 2 * graphs.captures
        runs[eager] = outs
    for a, b in zip(runs[True], runs[False], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.num_cached_tokens == b.num_cached_tokens
        torch.testing.assert_close(torch.stack(b.outputs[0].logits), torch.stack(a.outputs[0].logits),
                                   atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("which", ["plain_model", "hybrid_model"])
def test_async_scheduling_matches_synchronous_steps(request: pytest.FixtureRequest, which: str) -> None:
    """Decodes launched before the last tokens are read (engine.step_chain), their token ids
    taken from the device: the tokens, finish reasons and events of synchronous steps, with
    requests stopping mid-way on a token and by length."""
    from dataclasses import replace

    from engine.event_sink import RecordingEventSink

    path: Path = request.getfixturevalue(which)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (90, 20, 60, 33, 7)]
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(params: list[SamplingParams], chained: bool) -> tuple[list[tuple[list[int], str | None]], list[Any], int]:
        sink = RecordingEventSink()
        llm = LLM(str(path), device="cuda", dtype="bfloat16", max_num_batched_tokens=256, event_sink=sink,
                  async_scheduling=chained)
        outs = llm.generate(prompts, params)
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], sink.events, llm.engine.chain.launched

    free, _, _ = run([base] * 5, False)
    tokens = [t for t, _ in free]
    params = [base, replace(base, stop_token_ids=(tokens[1][9],)), replace(base, max_tokens=5), base,
              replace(base, stop_token_ids=(tokens[4][3],))]
    sync, chained = run(params, False), run(params, True)
    assert sync[2] == 0 and chained[2] > 10
    assert chained[0] == sync[0] and chained[1] == sync[1]
    assert [r for _, r in chained[0]] == ["length", "stop", "length", "length", "stop"]


_ULP = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_kernels_match_eager_formulas(dtype: torch.dtype) -> None:
    """engine.model.fused against the eager formulas it replaces, on shapes with ragged edges
    (a hidden size that is no power of two, a strided slice of the fused qkv for rope)."""
    pytest.importorskip("triton")
    import torch.nn.functional as F

    from engine.model import fused
    from engine.model.llama import RMSNorm, _rotate

    g = torch.Generator(device="cuda").manual_seed(0)
    x, h = (torch.randn(37, 320, device="cuda", generator=g).to(dtype) for _ in range(2))
    norm = RMSNorm(320, 1e-5).to("cuda", dtype)
    norm.weight.data.uniform_(0.5, 1.5, generator=g)
    s, y = fused.rms_norm(x, norm.weight, 1e-5, residual_in=h)
    assert torch.equal(s, x + h)
    tol = _ULP[dtype]
    torch.testing.assert_close(y, norm(x + h), atol=tol, rtol=tol)
    torch.testing.assert_close(fused.rms_norm(x, norm.weight, 1e-5)[1], norm(x), atol=tol, rtol=tol)
    gate_up = torch.randn(37, 2 * 1100, device="cuda", generator=g).to(dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_mul(gate_up), F.silu(gate) * up, atol=tol, rtol=tol)
    qkv = torch.randn(37, (6 + 2 * 3) * 64, device="cuda", generator=g).to(dtype)
    qk = qkv[:, : 9 * 64].view(37, 9, 64)  # row stride of the whole qkv, as the model's slice
    assert fused.rope_usable(qk)
    angles = torch.rand(37, 1, 32, device="cuda", generator=g) * 100
    cos = torch.cat((angles, angles), -1).cos().to(dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)
    torch.testing.assert_close(fused.rope(qk, cos, sin), _rotate(qk, cos, sin), atol=tol, rtol=tol)
    empty = x[:0]
    assert fused.rms_norm(empty, norm.weight, 1e-5)[1].shape == (0, 320)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_model_is_as_close_to_float32_as_eager(plain_model: Path, dtype: torch.dtype) -> None:
    """The whole forward with the fused kernels on (the default on CUDA) and off, each against
    the float32 forward: the kernels round where the eager ops round, so their error must be
    the eager path's (one-ulp differences in float32 exp/sqrt flip a half-precision rounding
    now and then, hence the margin, not equality)."""
    pytest.importorskip("triton")
    from engine.model.llama import enable_fused_kernels
    from engine.model.loader import load_model

    ids = torch.randint(0, 256, (2 * 70,), generator=torch.Generator().manual_seed(2)).cuda()
    pos = torch.arange(70, device="cuda").repeat(2)

    def logits(model: torch.nn.Module) -> torch.Tensor:
        with torch.inference_mode():
            return model.compute_logits(model(ids, pos, DenseCausalAttention(2))).float()

    reference = load_model(plain_model, "cuda", torch.float32)
    enable_fused_kernels(reference, False)
    ref = logits(reference)
    model = load_model(plain_model, "cuda", dtype)
    err = {}
    for on in (True, False):
        enable_fused_kernels(model, on)
        err[on] = (logits(model) - ref).abs().mean().item()
    assert err[True] <= 1.25 * err[False] + 1e-4, err
    torch.testing.assert_close(logits(model), ref, atol=0.15, rtol=0.1)


@pytest.mark.parametrize("which", ["plain_model", "hybrid_model"])
def test_cold_prefill_graphs_match_eager_steps(request: pytest.FixtureRequest, which: str) -> None:
    """Cold prefills too large for the step graphs replay a padded prefill graph
    (engine.prefill_graphs): same greedy tokens and logits as the eager runner, the padding's
    K/V kept out of the request's blocks (the decodes after it and a prefix hit read them)."""
    path: Path = request.getfixturevalue(which)
    window = 30 if which == "hybrid_model" else 200
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (window, window - 7, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, return_logits=True)
    runs = {}
    for eager in (True, False):
        llm = LLM(str(path), device="cuda", dtype="float32", max_num_batched_tokens=256, cuda_graph_max_tokens=8,
                  enforce_eager=eager)
        outs = [llm.generate(p, params)[0] for p in prompts] + llm.generate(prompts[:1], params)
        prefill = llm.engine.runner.prefill
        if eager:
            assert prefill is None
        else:
            assert prefill is not None and prefill.captures >= 1 and prefill.steps >= len(prompts)
        assert outs[-1].num_cached_tokens > 0
        runs[eager] = outs
    for a, b in zip(runs[True], runs[False], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(torch.stack(b.outputs[0].logits), torch.stack(a.outputs[0].logits),
                                   atol=1e-3, rtol=1e-3)


def _grid_attention_case(device: str, dtype: torch.dtype, rows: int, queries: int, nb: int,
                         window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton grid attention and the eager grid formula on one random layer: (kernel, eager,
    valid query rows)."""
    from engine import grid_kernels
    from engine.grid_attention import GridAttention
    from engine.grid_buffers import GridShape
    from engine.kv_cache import KVCacheGroup, KVCacheGroupSpec

    g = torch.Generator().manual_seed(rows * 100 + queries * 10 + nb)
    layers, bs, hkv, hq, d = 3, 16, 2, 8, 64
    cache = torch.randn(41, layers, 2, bs, hkv, d, generator=g).to(device, dtype)
    gather = torch.randint(1, 41, (rows * nb,), generator=g).to(device)
    keys = torch.arange(nb * bs)
    starts = torch.randint(0, nb * bs - queries, (rows,), generator=g)
    q_pos = starts[:, None] + torch.arange(queries)[None]
    counts = torch.tensor([queries] + [max(1, queries - 1)] * (rows - 1))
    allowed = keys[None, None] <= q_pos[:, :, None]
    if window is not None:
        allowed &= keys[None, None] > q_pos[:, :, None] - window
    valid = torch.arange(queries)[None] < counts[:, None]
    hidden = (~torch.where(valid[:, :, None], allowed, keys == 0))[:, None].to(device)
    q = torch.randn(rows * queries, hq + hkv, d, generator=g).to(device, dtype)[:, :hq]
    out = grid_kernels.grid_attention(q, cache, 1, gather, hidden, rows, queries)
    spec = KVCacheGroupSpec(0, "full_attention", None, tuple(range(layers)))
    eager = GridAttention([KVCacheGroup(spec, cache, bs)], {i: (0, i) for i in range(layers)},
                          GridShape(rows, queries, (nb,)), [torch.zeros(layers, 2, rows * queries, dtype=torch.long,
                                                                        device=device)], [gather], [hidden])
    eager.flat = [torch.zeros(8, hkv, d, dtype=dtype, device=device)]  # its K/V writes go to scratch
    scratch = torch.zeros(rows * queries, hkv, d, dtype=dtype, device=device)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grid_kernels, "usable", lambda *_: False)
        ref = eager(1, q, scratch, scratch)
    return out, ref, valid.reshape(-1).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "queries", "nb", "window"),
                         [(1, 1, 256, None), (1, 1, 20, None), (32, 1, 16, None), (3, 16, 8, 40), (5, 2, 4, None)])
def test_grid_attention_kernel_matches_eager_formula(dtype: torch.dtype, rows: int, queries: int, nb: int,
                                                     window: int | None) -> None:
    """engine.grid_kernels (one row's keys split over many programs, then merged, or one
    program per row and KV head for a row of one key tile) against the grid's eager gather +
    two GEMMs + softmax, masks with a window and padded query slots."""
    pytest.importorskip("triton")
    from engine import grid_kernels

    splits = grid_kernels.key_splits(nb * 16, rows * 2, grid_kernels._num_sms(0))[0]
    assert (splits == 1) == (nb * 16 <= grid_kernels.BLOCK_N)  # one key tile: no merge
    out, ref, valid = _grid_attention_case("cuda", dtype, rows, queries, nb, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[valid], ref[valid], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_store_writes_what_rope_and_index_copy_write(dtype: torch.dtype) -> None:
    """engine.model.fused.rope_store (a grid step's rope, K and V writes in one kernel): the
    rotated queries of fused.rope, and in the cache exactly the rows two index_copy_ would
    write (the rotated keys, the values), nothing else."""
    pytest.importorskip("triton")
    from engine.model import fused

    g = torch.Generator(device="cuda").manual_seed(5)
    t, hq, hkv, d = 9, 12, 4, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", generator=g).to(dtype)
    qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    angles = torch.rand(t, 1, d // 2, device="cuda", generator=g) * 100
    cos = torch.cat((angles, angles), -1).cos().to(dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)
    rows = torch.randperm(60, device="cuda", generator=g)[: 2 * t]
    cache = torch.randn(60, hkv, d, device="cuda", generator=g).to(dtype)
    expected = cache.clone()
    rotated = fused.rope(qk, cos, sin)
    expected.index_copy_(0, rows[:t], rotated[:, hq:])
    expected.index_copy_(0, rows[t:], v)
    q = fused.rope_store(qk, cos, sin, hq, v, cache, rows[:t], rows[t:])
    assert q.shape == (t, hq, d) and torch.equal(q, rotated[:, :hq])
    assert torch.equal(cache, expected)


@pytest.mark.parametrize(("rows", "queries", "nb", "block_size", "window"),
                         [(1, 1, 16, 16, None), (4, 8, 8, 24, None), (3, 16, 4, 16, 40), (2, 1, 320, 16, 64)])
def test_grid_inputs_kernel_matches_torch_formula(rows: int, queries: int, nb: int, block_size: int,
                                                  window: int | None) -> None:
    """The grid prologue's write rows and mask from one kernel (engine.grid_inputs on CUDA)
    equal the torch formula's, with padding rows and query slots."""
    pytest.importorskip("triton")
    from engine import grid_inputs

    g = torch.Generator().manual_seed(rows * 10 + queries)
    start, count, lo = (torch.zeros(rows, dtype=torch.long) for _ in range(3))
    gather = torch.zeros(rows * nb, dtype=torch.long)
    for i in range(max(1, rows - 1)):  # the last row is padding (all zeros) when there are several
        count[i] = int(torch.randint(1, queries + 1, (1,), generator=g))
        lo[i] = int(torch.randint(0, 3, (1,), generator=g)) * block_size
        start[i] = lo[i] + int(torch.randint(0, nb * block_size - queries, (1,), generator=g))
        gather[i * nb : (i + 1) * nb] = torch.randint(1, 500, (nb,), generator=g)
    args = [x.cuda() for x in (start, count, lo, gather)]
    want = grid_inputs.formula(*args, queries, nb, block_size, 5, window)
    got = grid_inputs.rows_and_mask(*args, queries, nb, block_size, 5, window)
    assert torch.equal(got[0], want[0]) and got[1].dtype == torch.bool and torch.equal(got[1], want[1])
