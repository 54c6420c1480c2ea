"""DCP merge on CUDA ranks (``cuda_pools``: one GPU per rank over NCCL where there are enough,
else W processes sharing one GPU over gloo): symm_a2a eager (W = 2, 3, 4) and in CUDA graphs
(both capture modes, PDL on and off, two graphs of one merger, a producer kernel before the
merge, eager merges between replays) against fp64 and the staged ``reference`` backend, the
collective backends, auto (by rule on a shared GPU), and the timeout of one peer among W. Run
on the device: ``pytest -m gpu tests/gpu``."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import attncomm
from attncomm import config
from attncomm.dcp import DcpMerger, merge, merge_states
from attncomm.dcp.lse_merge.symm_a2a import pdl_supported
from _gpu_ranks import CAPTURE_MODES, capture, dev, gather, shared_gpu
from _reference import ref_merge
from _symm_interp import _next_epoch, _scrubs, _signal_cells as signal_cells

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1)]

W = 2
NEG_INF = float("-inf")
NAN = float("nan")


# ------------------------------------------------------------------------------------------
# helpers (run on the ranks)
# ------------------------------------------------------------------------------------------

def _inputs(gen, T, H, D, dtype, *, empty_rank=None, rank=0, p_empty=0.15, all_empty=None):
    """Fresh partial output / LSE with some empty rows (LSE −inf, +inf or NaN) whose payload is
    NaN (must never leak); ``all_empty [T, H]`` (the same on every rank): rows empty on every
    rank (merged: exactly 0, LSE −inf)."""
    d = dev()
    out = torch.randn((T, H, D), generator=gen, device=d).to(dtype)
    lse = torch.randn((T, H), generator=gen, device=d) * 3 + rank
    empty = torch.rand((T, H), generator=gen, device=d) < p_empty
    if empty_rank is not None and empty_rank == rank:
        empty[:] = True
    if all_empty is not None:
        empty |= all_empty
    lse[empty] = NEG_INF
    # +inf (FlashAttention's keyless row) and NaN mark an empty shard too
    kind = torch.rand((T, H), generator=gen, device=d)
    lse[empty & (kind < 1 / 3)] = float("inf")
    lse[empty & (kind >= 1 / 3) & (kind < 2 / 3)] = NAN
    out[empty] = NAN
    return out, lse


def _ref64(outs, lses, rank, H):
    """fp64 reference for this rank's head slice: ``outs [W, T, H, D]``, ``lses [W, T, H]``."""
    hs = H // outs.shape[0]
    sl = slice(rank * hs, (rank + 1) * hs)
    return ref_merge(outs[:, :, sl], lses[:, :, sl])


def _tol(dtype):
    return {torch.bfloat16: 1.2e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]


def _assert_close(got, got_lse, outs, lses, rank, H, dtype, what):
    ref, ref_lse = _ref64(outs, lses, rank, H)
    tol = _tol(dtype)
    assert got.dtype == dtype and got_lse.dtype == torch.float32, what
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    err = ((got.double() - ref).abs() - tol * ref.abs()).max().item() if got.numel() else 0.0
    assert err <= tol, f"{what}: max error {err} > {tol}"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(got_lse), empty), f"{what}: −inf LSE rows differ"
    assert (got[empty] == 0).all(), f"{what}: empty rows are not exactly 0"
    fin = ~empty
    if fin.any():
        lerr = (got_lse[fin].double() - ref_lse[fin]).abs().max().item()
        assert lerr <= 1e-4, f"{what}: LSE error {lerr}"
    # and the library's own reference agrees
    hs = H // outs.shape[0]
    sl = slice(rank * hs, (rank + 1) * hs)
    ms, ms_lse = merge_states(outs[:, :, sl], lses[:, :, sl], return_lse=True)
    assert ((got.float() - ms.float()).abs() <= 2 * tol * (1 + ms.float().abs())).all(), what


def _poison(merger):
    impl = merger._impl
    if hasattr(impl, "res"):
        impl.res.fill_(float("nan"))
        impl.res_lse.fill_(float("nan"))


# ------------------------------------------------------------------------------------------
# rank functions
# ------------------------------------------------------------------------------------------

def _eager_many(rank, world_size, backend, dtype, H, D, max_tokens, tokens):
    gen = torch.Generator(device=dev()).manual_seed(1000 + rank)
    merger = DcpMerger(max_tokens=max_tokens, num_heads=H, head_dim=D, dtype=dtype,
                       backend=backend)
    assert merger.backend == backend, merger.backend
    for i, T in enumerate(tokens):
        # now and then a rank's shard is empty
        empty_rank = i % world_size if i % 3 == 2 else None
        out, lse = _inputs(gen, T, H, D, dtype, empty_rank=empty_rank, rank=rank)
        out_in, lse_in = out.clone(), lse.clone()
        _poison(merger)
        got, got_lse = merger(out, lse, return_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16 if out.element_size() == 2 else torch.int32),
                           out_in.view(torch.int16 if out.element_size() == 2
                                       else torch.int32)), "input modified"
        assert torch.equal(lse.view(torch.int32), lse_in.view(torch.int32)), "input LSE modified"
        _assert_close(got, got_lse, gather(out), gather(lse), rank, H, dtype,
                      f"{backend} {dtype} T={T}")
    merger.check()
    return len(tokens)


def _graph_replays(rank, world_size, dtype, T, replays):
    H, D = 16, 192
    gen = torch.Generator(device=dev()).manual_seed(2000 + rank)
    merger = DcpMerger(max_tokens=64, num_heads=H, head_dim=D, dtype=dtype, backend="symm_a2a")
    static_out, static_lse = _inputs(gen, T, H, D, dtype, rank=rank)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        merger(static_out, static_lse, return_lse=True)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # one merge per graph: consecutive replays alternate the parity slot
        g_out, g_lse = merger(static_out, static_lse, return_lse=True)
    for i in range(replays):
        out, lse = _inputs(gen, T, H, D, dtype, rank=rank, empty_rank=1 if i % 17 == 5 else None)
        static_out.copy_(out)
        static_lse.copy_(lse)
        _poison(merger)
        graph.replay()
        if i % 10 == 3:  # eager calls interleaved with replays share the epoch
            e_out, e_lse = _inputs(gen, T + 3, H, D, dtype, rank=rank)
            eo, el = merger(e_out, e_lse, return_lse=True)
            _assert_close(eo.clone(), el.clone(), gather(e_out), gather(e_lse), rank, H,
                          dtype, f"eager between replays {i}")
            _poison(merger)
            graph.replay()
        torch.cuda.synchronize()
        merger.check()
        _assert_close(g_out.clone(), g_lse.clone(), gather(static_out), gather(static_lse),
                      rank, H, dtype, f"replay {i}")
    state = merger._impl.ws.state.cpu().tolist()
    return state[0]


def _producer_and_merge(merger, src, static):
    """What a graph of ``_graphs_vs_staged`` runs: a producer kernel writing the merge's inputs
    in place (the copy of fresh inputs ``src`` into the static ``static``), then the merge."""
    def step():
        for dst, s in zip(static, src):
            dst.copy_(s)
        return merger(*static, return_lse=True)
    return step


def _all_empty(seed, i, T, H):
    """Rows empty on every rank for call ``i`` (the same mask on every rank), row 0 head 0
    always among them."""
    g = torch.Generator(device=dev()).manual_seed(seed * 7919 + i)
    mask = torch.rand((T, H), generator=g, device=dev()) < 0.04
    mask[0, 0] = True
    return mask


def _assert_staged_close(got, got_lse, want, want_lse, dtype, what):
    """symm_a2a against the staged ``reference`` backend on the same inputs: within twice the
    dtype's merge tolerance, the same empty (−inf) rows, LSEs within 1e-4."""
    tol = _tol(dtype)
    assert ((got.float() - want.float()).abs() <= 2 * tol * (1 + want.float().abs())).all(), \
        f"{what}: symm_a2a and reference differ"
    assert torch.equal(torch.isinf(got_lse), torch.isinf(want_lse)), f"{what}: empty rows"
    fin = torch.isfinite(want_lse)
    if fin.any():
        lerr = (got_lse[fin] - want_lse[fin]).abs().max().item()
        assert lerr <= 1e-4, f"{what}: LSE vs reference {lerr}"


def _graphs_vs_staged(rank, world_size, seed, pdl, mode, replays):
    """symm_a2a against fp64 and against the staged ``reference`` backend on the same inputs.
    Two graphs of one merger (an LL and a flag token count, as an engine keeps one graph per
    batch size), each captured in ``mode`` right after eager calls of its shape, with a
    producer kernel before the merge; replayed alternately with fresh inputs (empty shards:
    LSE −inf / +inf / NaN over NaN payloads, a whole rank's shard now and then, rows empty on
    every rank); eager merges of a third token count between replays. PDL forced on or off
    (``ATTNCOMM_SYMM_PDL``, read when the merger builds its backend). Returns the final device
    epoch, how much it grew and how many merges ran."""
    H, D, dtype = 64, 512, torch.bfloat16  # LL up to 8 tokens, flag above
    d = dev()
    with config.setting(ATTNCOMM_SYMM_PDL="1" if pdl else "0"):
        m = DcpMerger(max_tokens=48, num_heads=H, head_dim=D, dtype=dtype, backend="symm_a2a")
    assert m._impl.pdl == (pdl and pdl_supported(d)), (m._impl.pdl, pdl)
    staged = DcpMerger(max_tokens=48, num_heads=H, head_dim=D, dtype=dtype,
                       backend="reference")
    gen = torch.Generator(device=d).manual_seed(seed * 100 + rank)
    graphs = {}
    for T in (5, 37):
        src = _inputs(gen, T, H, D, dtype, rank=rank)
        static = tuple(torch.empty_like(t) for t in src)
        step = _producer_and_merge(m, src, static)
        for _ in range(2):  # eager calls of the shape, then its capture (as engines do)
            step()
        graph, res = capture(step, mode)
        graphs[T] = (graph, src, static, res)
    torch.cuda.synchronize()
    e0 = int(m._impl.ws.state[0])
    merges = 0
    for i in range(replays):
        T = (5, 37)[i % 2]
        graph, src, static, (g_out, g_lse) = graphs[T]
        empty_rank = (i // 2) % world_size if i % 5 == 4 else None
        for dst, t in zip(src, _inputs(gen, T, H, D, dtype, rank=rank, empty_rank=empty_rank,
                                       all_empty=_all_empty(seed, i, T, H))):
            dst.copy_(t)
        _poison(m)
        graph.replay()
        merges += 1
        torch.cuda.synchronize()
        m.check()
        got, got_lse = g_out.clone(), g_lse.clone()
        what = f"pdl={pdl} {mode} replay {i} T={T}"
        _assert_close(got, got_lse, gather(static[0]), gather(static[1]), rank, H, dtype, what)
        _assert_staged_close(got, got_lse, *staged(*static, return_lse=True), dtype, what)
        if i % 7 == 3:  # an eager merge between replays continues the same epoch
            e_in = _inputs(gen, 9, H, D, dtype, rank=rank,
                           all_empty=_all_empty(seed, replays + i, 9, H))
            _poison(m)
            e_out, e_lse = (t.clone() for t in m(*e_in, return_lse=True))
            merges += 1
            what = f"pdl={pdl} {mode} eager after replay {i}"
            _assert_close(e_out, e_lse, gather(e_in[0]), gather(e_in[1]), rank, H, dtype, what)
            _assert_staged_close(e_out, e_lse, *staged(*e_in, return_lse=True), dtype, what)
    torch.cuda.synchronize()
    m.check()
    epochs = gather(m._impl.ws.state[:1].clone()).view(-1).tolist()
    assert len(set(epochs)) == 1, f"device epochs differ across ranks: {epochs}"
    return epochs[0], epochs[0] - e0, merges


def _two_mergers(rank, world_size):
    gen = torch.Generator(device=dev()).manual_seed(3000 + rank)
    H, D = 8, 64
    a = DcpMerger(max_tokens=40, num_heads=H, head_dim=D, dtype=torch.bfloat16,
                  backend="symm_a2a")
    b = DcpMerger(max_tokens=9, num_heads=H, head_dim=D, dtype=torch.float16,
                  backend="symm_a2a")
    assert a._impl.ws.slab.data_ptr() != b._impl.ws.slab.data_ptr()
    for i in range(20):
        for m, dtype, T in ((a, torch.bfloat16, 1 + (7 * i) % 40), (b, torch.float16,
                                                                     1 + i % 9)):
            out, lse = _inputs(gen, T, H, D, dtype, rank=rank)
            got, got_lse = m(out, lse, return_lse=True)
            _assert_close(got.clone(), got_lse.clone(), gather(out), gather(lse), rank, H,
                          dtype, f"merger {dtype} T={T}")
    return True


def _signal_cells(impl, slot):
    """Every flag and LL word of this rank's slot ``slot`` from each peer, as int32 views."""
    return [c for q in range(impl.world_size) if q != impl.rank
            for c in signal_cells(impl.ws.slab, impl.layout, slot, q)]


def _epoch_wrap(rank, world_size, epoch0, tokens):
    """Calls from epoch ``epoch0`` on, in both protocols (T ≤ 8 is LL at 64 heads × 512): the
    results, the epochs, and at a scrub epoch (≡ 0, 1 mod 2**30) the other slot's flags and LL
    words, planted beforehand with the next call's epoch (a stale cell that would match), zeroed.

    Jumping the epoch to ``epoch0`` would replay epochs the warm-up merges already wrote (cells
    that a real merger scrubs long before the epoch comes round again), so every flag and LL
    word of both slots is zeroed first."""
    from attncomm import cpu_group
    H, D, dtype = 64, 512, torch.bfloat16
    gen = torch.Generator(device=dev()).manual_seed(6000 + rank)
    m = DcpMerger(max_tokens=64, num_heads=H, head_dim=D, dtype=dtype, backend="symm_a2a")
    impl = m._impl
    torch.cuda.synchronize()
    dist.barrier(group=cpu_group())
    for slot in (0, 1):
        for c in _signal_cells(impl, slot):
            c.zero_()
    impl.ws.state[0] = epoch0
    epochs = []
    for T in tokens:
        e = _next_epoch(int(impl.ws.state[0]))
        scrub = _scrubs(e)
        if scrub:
            for c in _signal_cells(impl, 1 - (e & 1)):
                c.fill_(_next_epoch(e))
        torch.cuda.synchronize()
        dist.barrier(group=cpu_group())
        out, lse = _inputs(gen, T, H, D, dtype, rank=rank)
        _poison(m)
        got, got_lse = m(out, lse, return_lse=True)
        torch.cuda.synchronize()
        epochs.append(int(impl.ws.state[0]))
        _assert_close(got.clone(), got_lse.clone(), gather(out), gather(lse), rank, H, dtype,
                      f"epoch {epochs[-1]} T={T}")
        if scrub:
            left = sum(int((c != 0).sum()) for c in _signal_cells(impl, 1 - (e & 1)))
            assert left == 0, f"epoch {e}: {left} words of the other slot not zeroed"
    return epochs


def _auto_and_merge(rank, world_size):
    m = DcpMerger(max_tokens=32, num_heads=64, head_dim=512, dtype=torch.bfloat16)
    gen = torch.Generator(device=dev()).manual_seed(4000 + rank)
    out, lse = _inputs(gen, 5, 64, 512, torch.bfloat16, rank=rank)
    got, got_lse = merge(out, lse, backend="symm_a2a", return_lse=True)
    _assert_close(got, got_lse, gather(out), gather(lse), rank, 64, torch.bfloat16,
                  "merge(symm_a2a)")
    return m.backend, m.fallback_reason, m.decision.rule, shared_gpu()


def _timeout_path(rank, world_size):
    """The last rank skips one merge: every other rank's kernel gives up at its device-side
    deadline and names that rank alone (its other peers took part)."""
    from attncomm import PeerTimeoutError, cpu_group
    silent = world_size - 1
    H, D = 4 * world_size, 64
    m = DcpMerger(max_tokens=8, num_heads=H, head_dim=D, dtype=torch.bfloat16,
                  backend="symm_a2a", timeout_s=2.0)
    gen = torch.Generator(device=dev()).manual_seed(5000 + rank)
    out, lse = _inputs(gen, 4, H, D, torch.bfloat16, rank=rank)
    m(out, lse)  # one good call
    torch.cuda.synchronize()
    m.check()
    dist.barrier(group=cpu_group())
    result = "skipped"
    if rank != silent:
        t0 = time.monotonic()
        try:
            m(out, lse)  # no host sync: the timeout is found by check() or the next call
            torch.cuda.synchronize()  # the kernel gives up at its device-side deadline
            m.check()
            result = "no error"
        except PeerTimeoutError as exc:
            waited = time.monotonic() - t0
            assert exc.peer_ranks == [silent], exc.peer_ranks
            assert waited < 2.0 + 5.0, waited
            result = f"timeout after {waited:.2f}s"
        try:
            m(out, lse)
            result += "; reuse allowed"
        except PeerTimeoutError as exc:  # broken for good, the same error type
            assert "unusable" in str(exc) and exc.peer_ranks == [silent], exc
    # the silent rank keeps its slab mapped until the others' kernels have finished with it
    dist.barrier(group=cpu_group())
    torch.cuda.synchronize()
    return result


# ------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_symm_a2a_eager_tokens(cuda_pools, dtype, world):
    tokens = [1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 100, 127, 128, 129, 130]
    cuda_pools.run(world, _eager_many, "symm_a2a", dtype, 8 * world, 192, 130, tokens,
                   timeout_s=240)
    cuda_pools.run(world, _eager_many, "symm_a2a", dtype, 32 * world, 512, 128,
                   [1, 8, 37, 128], timeout_s=240)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_symm_a2a_graph_replays(cuda_pools, dtype):
    epochs = cuda_pools.run(W, _graph_replays, dtype, 37, 110, timeout_s=240)
    assert len(set(epochs)) == 1 and epochs[0] > 110, epochs


@pytest.mark.parametrize("mode", CAPTURE_MODES)
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no_pdl"])
def test_symm_a2a_graphs_vs_fp64_and_staged(cuda_pools, pdl, mode, seed):
    replays = 200
    res = cuda_pools.run(W, _graphs_vs_staged, seed, pdl, mode, replays, timeout_s=240)
    assert len(set(res)) == 1, res
    epoch, grew, merges = res[0]
    assert merges > replays and grew == merges, f"seed {seed}: {res}"


def test_epoch_wrap_and_scrub(cuda_pools):
    tokens = (1, 40, 3, 64, 8, 9)
    epochs = cuda_pools.run(W, _epoch_wrap, -4, tokens, timeout_s=120)  # int32 wrap, 0 skipped
    assert epochs[0] == epochs[1] == [-3, -2, -1, 2, 3, 4], epochs
    # scrubs at 2**30 and 2**30 + 1
    epochs = cuda_pools.run(W, _epoch_wrap, 2 ** 30 - 3, tokens, timeout_s=120)
    assert epochs[0] == epochs[1] == [2 ** 30 + i for i in range(-2, 4)], epochs


def test_two_mergers(cuda_pools):
    cuda_pools.run(W, _two_mergers, timeout_s=120)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("backend", ["ag_rs", "a2a", "reference"])
def test_nccl_backends(cuda_pools, backend, world):
    """The collective backends: NCCL on GPUs of their own, gloo staged through the host on a
    shared GPU."""
    cuda_pools.run(world, _eager_many, backend, torch.bfloat16, 8 * world, 128, 70,
                   [1, 3, 16, 33, 70], timeout_s=240)


def test_auto_takes_symm(cuda_pools):
    res = cuda_pools.run(W, _auto_and_merge, timeout_s=120)
    assert all(r == res[0] for r in res), res
    backend, fallback, rule, shared = res[0]
    assert backend == "symm_a2a" and fallback is None, res
    if shared:  # time-sliced ranks: chosen by rule, not timed
        assert rule is not None and rule.startswith("shared GPU"), res
    else:
        assert rule is None, res


@pytest.mark.parametrize("world", [2, 3, 4])
def test_timeout_path(world):
    t0 = time.monotonic()
    res = attncomm.launch(_timeout_path, world, device="cuda", timeout_s=240)
    assert all(r.startswith("timeout after") and "reuse" not in r for r in res[:-1]), res
    assert res[-1] == "skipped", res
    assert time.monotonic() - t0 < 240
