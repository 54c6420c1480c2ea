"""DCP merge on CUDA ranks (W=2 through NCCL): symm_a2a eager and in CUDA graphs, the NCCL
backends, auto, and the timeout path. Run on the device: ``pytest -m gpu tests/gpu``."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import attncomm
from attncomm.dcp import DcpMerger, merge, merge_states
from _reference import ref_merge
from _symm_interp import _next_epoch, _scrubs, _signal_cells as signal_cells

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2)]

W = 2
NEG_INF = float("-inf")


def _need_gpus():
    if not torch.cuda.is_available() or torch.cuda.device_count() < W:
        pytest.skip(f"needs {W} GPUs")


@pytest.fixture(scope="module")
def cuda_pool():
    _need_gpus()
    pool = attncomm.RankPool(W, device="cuda")
    yield pool
    pool.close(force=not pool.alive)


# ------------------------------------------------------------------------------------------
# helpers (run on the ranks)
# ------------------------------------------------------------------------------------------

def _inputs(gen, T, H, D, dtype, *, empty_rank=None, rank=0, p_empty=0.15):
    """Fresh partial output / LSE with some empty rows (LSE −inf or +inf) whose payload is NaN
    (must never leak)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    out = torch.randn((T, H, D), generator=gen, device=dev).to(dtype)
    lse = torch.randn((T, H), generator=gen, device=dev) * 3 + rank
    empty = torch.rand((T, H), generator=gen, device=dev) < p_empty
    if empty_rank is not None and empty_rank == rank:
        empty[:] = True
    lse[empty] = NEG_INF
    # +inf (FlashAttention's keyless row) marks an empty shard too
    lse[empty & (torch.rand((T, H), generator=gen, device=dev) < 0.5)] = float("inf")
    out[empty] = float("nan")
    return out, lse


def _gather(x):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.stack(parts)


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
    gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
    merger = DcpMerger(max_tokens=max_tokens, num_heads=H, head_dim=D, dtype=dtype,
                       backend=backend)
    assert merger.backend == backend, merger.backend
    for i, T in enumerate(tokens):
        empty_rank = (i % 2) if i % 3 == 2 else None  # now and then a rank's shard is empty
        out, lse = _inputs(gen, T, H, D, dtype, empty_rank=empty_rank, rank=rank)
        out_in, lse_in = out.clone(), lse.clone()
        _poison(merger)
        got, got_lse = merger(out, lse, return_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16 if out.element_size() == 2 else torch.int32),
                           out_in.view(torch.int16 if out.element_size() == 2
                                       else torch.int32)), "input modified"
        assert torch.equal(lse, lse_in), "input LSE modified"
        _assert_close(got, got_lse, _gather(out), _gather(lse), rank, H, dtype,
                      f"{backend} {dtype} T={T}")
    merger.check()
    return len(tokens)


def _graph_replays(rank, world_size, dtype, T, replays):
    H, D = 16, 192
    gen = torch.Generator(device="cuda").manual_seed(2000 + rank)
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
            _assert_close(eo.clone(), el.clone(), _gather(e_out), _gather(e_lse), rank, H,
                          dtype, f"eager between replays {i}")
            _poison(merger)
            graph.replay()
        torch.cuda.synchronize()
        merger.check()
        _assert_close(g_out.clone(), g_lse.clone(), _gather(static_out), _gather(static_lse),
                      rank, H, dtype, f"replay {i}")
    state = merger._impl.ws.state.cpu().tolist()
    return state[0]


def _two_mergers(rank, world_size):
    gen = torch.Generator(device="cuda").manual_seed(3000 + rank)
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
            _assert_close(got.clone(), got_lse.clone(), _gather(out), _gather(lse), rank, H,
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
    gen = torch.Generator(device="cuda").manual_seed(6000 + rank)
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
        _assert_close(got.clone(), got_lse.clone(), _gather(out), _gather(lse), rank, H, dtype,
                      f"epoch {epochs[-1]} T={T}")
        if scrub:
            left = sum(int((c != 0).sum()) for c in _signal_cells(impl, 1 - (e & 1)))
            assert left == 0, f"epoch {e}: {left} words of the other slot not zeroed"
    return epochs


def _auto_and_merge(rank, world_size):
    m = DcpMerger(max_tokens=32, num_heads=64, head_dim=512, dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(4000 + rank)
    out, lse = _inputs(gen, 5, 64, 512, torch.bfloat16, rank=rank)
    got, got_lse = merge(out, lse, backend="symm_a2a", return_lse=True)
    _assert_close(got, got_lse, _gather(out), _gather(lse), rank, 64, torch.bfloat16,
                  "merge(symm_a2a)")
    return m.backend, m.fallback_reason


def _timeout_path(rank, world_size):
    from attncomm import PeerTimeoutError, cpu_group
    H, D = 8, 64
    m = DcpMerger(max_tokens=8, num_heads=H, head_dim=D, dtype=torch.bfloat16,
                  backend="symm_a2a", timeout_s=2.0)
    gen = torch.Generator(device="cuda").manual_seed(5000 + rank)
    out, lse = _inputs(gen, 4, H, D, torch.bfloat16, rank=rank)
    m(out, lse)  # one good call
    result = "skipped"
    if rank == 0:
        t0 = time.monotonic()
        try:
            m(out, lse)  # no host sync: the timeout is found by check() or the next call
            torch.cuda.synchronize()  # the kernel gives up at its device-side deadline
            m.check()
            result = "no error"
        except PeerTimeoutError as exc:
            waited = time.monotonic() - t0
            assert exc.peer_ranks == [1], exc.peer_ranks
            assert waited < 2.0 + 5.0, waited
            result = f"timeout after {waited:.2f}s"
        try:
            m(out, lse)
            result += "; reuse allowed"
        except PeerTimeoutError as exc:  # broken for good, the same error type
            assert "unusable" in str(exc) and exc.peer_ranks == [1], exc
    # rank 1 keeps its slab mapped until rank 0's kernel has finished with it
    dist.barrier(group=cpu_group())
    torch.cuda.synchronize()
    return result


# ------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_symm_a2a_eager_tokens(cuda_pool, dtype):
    tokens = [1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 100, 127, 128, 129, 130]
    cuda_pool.run(_eager_many, "symm_a2a", dtype, 16, 192, 130, tokens)
    cuda_pool.run(_eager_many, "symm_a2a", dtype, 64, 512, 128, [1, 8, 37, 128])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_symm_a2a_graph_replays(cuda_pool, dtype):
    epochs = cuda_pool.run(_graph_replays, dtype, 37, 110)
    assert epochs[0] == epochs[1] and epochs[0] > 110


def test_epoch_wrap_and_scrub(cuda_pool):
    tokens = (1, 40, 3, 64, 8, 9)
    epochs = cuda_pool.run(_epoch_wrap, -4, tokens)  # int32 wrap, 0 skipped
    assert epochs[0] == epochs[1] == [-3, -2, -1, 2, 3, 4], epochs
    epochs = cuda_pool.run(_epoch_wrap, 2 ** 30 - 3, tokens)  # scrubs at 2**30 and 2**30 + 1
    assert epochs[0] == epochs[1] == [2 ** 30 + i for i in range(-2, 4)], epochs


def test_two_mergers(cuda_pool):
    cuda_pool.run(_two_mergers)


@pytest.mark.parametrize("backend", ["ag_rs", "a2a", "reference"])
def test_nccl_backends(cuda_pool, backend):
    cuda_pool.run(_eager_many, backend, torch.bfloat16, 16, 128, 70, [1, 3, 16, 33, 70])


def test_auto_takes_symm(cuda_pool):
    res = cuda_pool.run(_auto_and_merge)
    assert res[0] == res[1]
    assert res[0][0] == "symm_a2a", res


def test_timeout_path():
    _need_gpus()
    t0 = time.monotonic()
    res = attncomm.launch(_timeout_path, W, device="cuda", timeout_s=240)
    assert res[0].startswith("timeout after"), res
    assert res[1] == "skipped"
    assert time.monotonic() - t0 < 240
