"""Single-process simulation of a W-rank symm_a2a merge under the Triton interpreter (CPU).

Run as a script with TRITON_INTERPRET=1 (tests/test_symm_cpu.py does this in a subprocess).
Rank 0's kernel runs for real; every other rank's contribution is staged into rank 0's slab
exactly as that rank's kernel would store it (flags or LL tags with the right epoch), so the
waits find their data at once (the interpreter cannot spin on a clock). Checks: rank 0's merged
slice against an fp64 reference, what rank 0 stored into each peer's slab, the device epoch, and
both parity slots over consecutive calls.
"""
from __future__ import annotations

import sys

import torch

from attncomm.dcp.lse_merge.symm_a2a import MergeSlab, SymmConfig, launch_merge, plan_blocks, use_ll
from attncomm.dcp.lse_merge.symm_layout import SlabLayout
from _reference import ref_merge

NEG_INF = float("-inf")
CONFIG = SymmConfig()  # main() replaces it: the stagger knobs test_symm_cpu varies


def _aligned(nbytes: int) -> torch.Tensor:
    raw = torch.zeros(nbytes + 256, dtype=torch.uint8)
    off = (-raw.data_ptr()) % 256
    return raw[off:off + nbytes]


def _ref64(outs, lses, sl):
    return ref_merge(outs[:, :, sl], lses[:, :, sl])


def _stage(slab, layout, e, src, rows_o, rows_l, n_blocks):
    """Store source ``src``'s rows for rank 0 into rank 0's slab as ``src``'s kernel would."""
    st = layout.kernel_strides()
    slot = e & 1
    W = layout.world_size
    cell = slot * W + src
    n = rows_o.shape[0]
    if use_ll(n, layout):
        words = rows_o.contiguous().view(torch.int32).reshape(n, -1).to(torch.int64) & 0xFFFFFFFF
        tag = e << 32
        q = slab.view(torch.int64)
        base = st["llo_base"] + cell * st["llo_cell"]
        q[base:base + words.numel()] = (words | tag).reshape(-1)
        lw = rows_l.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        base = st["lll_base"] + cell * st["lll_cell"]
        q[base:base + n] = lw | tag
    else:
        o = slab.view(rows_o.dtype)
        base = cell * st["o_cell"]
        o[base:base + rows_o.numel()] = rows_o.reshape(-1)
        f32 = slab.view(torch.float32)
        base = st["l_base"] + cell * st["l_cell"]
        f32[base:base + n] = rows_l
        i32 = slab.view(torch.int32)
        base = st["f_base"] + cell * st["f_cell"]
        i32[base:base + n_blocks] = e


def _next_epoch(e: int) -> int:
    """The epoch after ``e``, as the kernels count: int32, wrapping, skipping 0 (→ 2)."""
    e = (e + 1 + 2 ** 31) % 2 ** 32 - 2 ** 31
    return 2 if e == 0 else e


def _scrubs(e: int) -> bool:
    """Whether the call of epoch ``e`` zeroes the other slot's flags and LL words first."""
    return (e >> 1) & (2 ** 29 - 1) == 0


def _signal_cells(slab, layout, slot, src):
    """Views of every flag and LL word of cell (``slot``, ``src``) in ``slab``, as int32."""
    st = layout.kernel_strides()
    cell = slot * layout.world_size + src
    w = slab.view(torch.int32)
    f = st["f_base"] + cell * st["f_cell"]
    o = 2 * (st["llo_base"] + cell * st["llo_cell"])
    x = 2 * (st["lll_base"] + cell * st["lll_cell"])
    return [w[f:f + st["f_cell"]], w[o:o + 2 * st["llo_cell"]], w[x:x + 2 * st["lll_cell"]]]


def _sent(slab, layout, e, src, n, dtype, D):
    """What ``src`` (here rank 0) stored into this peer slab for epoch ``e``: (rows, lse)."""
    st = layout.kernel_strides()
    cell = (e & 1) * layout.world_size + src
    if use_ll(n, layout):
        q = slab.view(torch.int64)
        base = st["llo_base"] + cell * st["llo_cell"]
        words = q[base:base + n * layout.row_words]
        assert bool(((words >> 32) == e).all()), "LL tags do not carry the epoch"
        rows = (words & 0xFFFFFFFF).to(torch.int32).view(dtype).reshape(n, D)
        base = st["lll_base"] + cell * st["lll_cell"]
        lw = q[base:base + n]
        assert bool(((lw >> 32) == e).all())
        return rows, (lw & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    base = cell * st["o_cell"]
    rows = slab.view(dtype)[base:base + n * D].reshape(n, D)
    base = st["l_base"] + cell * st["l_cell"]
    return rows, slab.view(torch.float32)[base:base + n]


def _check_go_cells(slab, layout, e, n_rows, n_blocks, grid, D, itemsize):
    """Staggered sends: program p signalled its waiter p + first in rank 0's own flag cell of
    this slot (which no peer writes) exactly for p < grid − first; without staggering, none."""
    from attncomm.dcp.lse_merge.symm_a2a import stagger
    split = stagger(n_rows, n_blocks, grid, D, itemsize, CONFIG)
    first = max(-(-grid * split // 100), 1) if split else grid
    st = layout.kernel_strides()
    base = st["f_base"] + ((e & 1) * layout.world_size) * st["f_cell"]
    got = (slab.view(torch.int32)[base:base + grid] == e).tolist()
    assert got == [p < grid - first for p in range(grid)], (split, grid, got)


def run_case(W, H, D, T, max_tokens, dtype, ll, calls=2, seed=0, n_programs=3, epoch0=0):
    """Consecutive calls (epochs epoch0+1, epoch0+2, …: both parity slots; the epoch is int32,
    wraps and skips 0) on rank 0 of W ranks."""
    gen = torch.Generator().manual_seed(seed)
    hs = H // W
    itemsize = torch.empty((), dtype=dtype).element_size()
    max_rows = max_tokens * hs
    layout = SlabLayout(W, max_rows, D, itemsize, max_rows if ll else 0)
    slabs = [_aligned(layout.total_bytes) for _ in range(W)]
    state = torch.zeros(4, dtype=torch.int32)
    state[0] = epoch0
    errors = torch.zeros(W, dtype=torch.int32)
    ms = MergeSlab.build(layout, slabs[0], [s.data_ptr() for s in slabs], 0, state, errors,
                         10 ** 9)
    res = torch.full((max_tokens, hs, D), float("nan")).to(dtype)
    res_lse = torch.full((max_tokens, hs), float("nan"))
    n = T * hs
    assert use_ll(n, layout) == ll
    _, n_blocks, grid = plan_blocks(n, n_programs)
    worst = 0.0
    call = epoch0
    for _ in range(calls):
        call = _next_epoch(call)
        outs = torch.randn((W, T, H, D), generator=gen).to(dtype)
        lses = torch.randn((W, T, H), generator=gen) * 3
        empty = torch.rand((W, T, H), generator=gen) < 0.2
        empty[:, 0, 0] = True  # one row empty everywhere: exactly 0 and −inf
        if W > 1 and T > 1:
            empty[1, 1, :] = True  # a whole empty row on one source
        lses[empty] = NEG_INF
        # +inf (FlashAttention's keyless row) marks an empty shard too
        lses[empty & (torch.rand((W, T, H), generator=gen) < 0.5)] = float("inf")
        outs[empty] = float("nan")  # never read behind a non-finite LSE
        lses[0, -1, 0] = float("nan")  # NaN LSE counts as −inf
        if W > 1 and T > 2:  # a NaN payload under a contributing LSE propagates, element-exact
            lses[1, 2, 0] = 0.5
            outs[1, 2, 0, 0] = float("nan")
        for src in range(1, W):
            _stage(slabs[0], layout, call, src, outs[src][:, 0:hs].reshape(n, D),
                   lses[src][:, 0:hs].reshape(n), n_blocks)
        junk = _next_epoch(call)  # the other slot: stale cells that would match the next call
        for src in range(1, W):
            for c in _signal_cells(slabs[0], layout, 1 - (call & 1), src):
                c.fill_(junk)
        res.fill_(float("nan"))
        res_lse.fill_(float("nan"))
        launch_merge(outs[0].contiguous(), lses[0].contiguous(), res, res_lse, slab=ms, rank=0,
                     world_size=W, num_heads=H, layout=layout, n_programs_max=n_programs,
                     config=CONFIG)
        assert int(state[0]) == call and int(state[1]) == 0, state
        assert not bool(errors.any())
        if not ll:
            _check_go_cells(slabs[0], layout, call, n, n_blocks, grid, D, itemsize)
        for src in range(1, W):  # zeroed by a scrub call, untouched otherwise
            for c in _signal_cells(slabs[0], layout, 1 - (call & 1), src):
                assert bool((c == (0 if _scrubs(call) else junk)).all()), (
                    f"epoch {call}: other slot of source {src} {'not ' * _scrubs(call)}zeroed")
        ref, ref_lse = _ref64(outs, lses, slice(0, hs))  # non-finite LSE = empty (API.md)
        got, got_lse = res[:T].double(), res_lse[:T].double()
        assert torch.equal(torch.isnan(got), torch.isnan(ref)), "NaN placement"
        assert torch.isfinite(got[~torch.isnan(ref)]).all(), "non-finite output"
        tol = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-5}[dtype]
        fin = ~torch.isnan(ref)
        err = ((got[fin] - ref[fin]).abs() - tol * ref[fin].abs()).max().item()
        assert err <= tol, f"error {err} > {tol} (dtype {dtype}, T={T}, ll={ll})"
        inf = torch.isinf(ref_lse)
        assert torch.equal(torch.isinf(got_lse), inf)
        assert (got[inf] == 0).all()
        assert (got_lse[~inf] - ref_lse[~inf]).abs().max().item() <= 1e-5 if (~inf).any() else 1
        worst = max(worst, err)
        for q in range(1, W):  # what rank 0 sent to q: its rows of q's head slice, bit-exact
            rows, lse = _sent(slabs[q], layout, call, 0, n, dtype, D)
            want = outs[0][:, q * hs:(q + 1) * hs].reshape(n, D)
            assert torch.equal(rows.view(torch.uint8), want.contiguous().view(torch.uint8))
            want_l = lses[0][:, q * hs:(q + 1) * hs].reshape(n)
            assert torch.equal(lse.view(torch.int32), want_l.contiguous().view(torch.int32))
            if not ll:
                st = layout.kernel_strides()
                base = st["f_base"] + ((call & 1) * W) * st["f_cell"]
                flags = slabs[q].view(torch.int32)[base:base + n_blocks]
                assert bool((flags == call).all()), flags
    return worst


CASES = [
    # W, H, D, T, max_tokens, dtype, ll
    (2, 4, 24, 3, 5, torch.bfloat16, False),
    (2, 4, 24, 3, 5, torch.bfloat16, True),
    (2, 6, 40, 5, 7, torch.float16, True),
    (2, 6, 40, 5, 7, torch.float16, False),
    (3, 6, 16, 4, 4, torch.float32, False),
    (3, 6, 16, 4, 4, torch.float32, True),
    (4, 8, 20, 7, 9, torch.bfloat16, False),
    (1, 2, 8, 3, 3, torch.bfloat16, False),
    (2, 8, 8, 30, 30, torch.bfloat16, False),  # several blocks per program (pipelined)
    (2, 8, 8, 30, 30, torch.float16, True),
    (2, 4, 8, 70, 70, torch.bfloat16, False),  # 140 rows: 32-row blocks, 2 per program
    # the int32 epoch wraps from 2**31 - 1 to -2**31 (parity 1 → 0 → 1) ...
    (2, 4, 8, 3, 3, torch.bfloat16, False, 3, 1, 3, 2 ** 31 - 2),
    (2, 4, 8, 3, 3, torch.float16, True, 3, 2, 3, 2 ** 31 - 2),
    # ... and skips 0: -1 → 2 → 3 (parity 1 → 0 → 1)
    (2, 4, 8, 3, 3, torch.bfloat16, False, 3, 3, 3, -2),
    (2, 4, 8, 3, 3, torch.bfloat16, True, 3, 4, 3, -2),
    # scrub calls (epochs ≡ 0, 1 mod 2**30; the first call, epoch 1, is one too)
    (3, 6, 16, 4, 4, torch.float16, False, 3, 5, 3, 2 ** 30 - 2),
    (3, 6, 16, 4, 4, torch.float16, True, 3, 6, 3, 2 ** 30 - 2),
    (2, 4, 8, 30, 30, torch.bfloat16, True, 3, 7, 2, 2 ** 30 - 2),
    (2, 8, 8, 60, 60, torch.float16, True, 2, 5),  # LL: 4 blocks on 3 programs
]


class _FakeWorkspace:
    """A one-rank stand-in for SymmWorkspace on CPU (no SymmetricMemory there): the real
    PeerErrors (plain host words) and the workspace's own check methods."""

    def __init__(self, group, layout, device, *, op="symm", timeout_s=None, rendezvous=True,
                 mapping=None):
        from attncomm.symm import PeerErrors, SymmWorkspace
        self.layout = layout
        self.device = torch.device("cpu")
        self.slab = _aligned(layout.total_bytes)
        self.state = torch.zeros(4, dtype=torch.int32)
        self.failures = PeerErrors(1, self.device, op=op, timeout_s=timeout_s)
        self.errors = self.failures.words
        self.peer_ptrs = []
        for name in ("check", "ensure_usable", "sync_check"):
            setattr(self, name, getattr(SymmWorkspace, name).__get__(self))

    @classmethod
    def agreed(cls, group, size, device, *, op, timeout_s=None):
        from attncomm.symm import SymmWorkspace
        return SymmWorkspace.agreed.__func__(cls, group, size, device, op=op,
                                             timeout_s=timeout_s)

    def rendezvous(self):
        self.peer_ptrs = [self.slab.data_ptr()]
        self.handle = type("H", (), {"buffer_ptrs": self.peer_ptrs})()


def run_backend_w1() -> None:
    """The backend's host code end to end on one CPU rank (fake workspace, interpreter)."""
    import tempfile

    import torch.distributed as dist

    import attncomm.dcp.exchange as exchange
    import attncomm.dcp.lse_merge.symm_a2a as mod
    from attncomm.dcp.lse_merge.combine import combine_torch

    path = tempfile.mktemp(prefix="attncomm-interp-")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        exchange.SymmWorkspace = _FakeWorkspace  # where the symm backends map their slab
        torch.cuda.is_current_stream_capturing = lambda: False
        b = mod.SymmA2ABackend(None, max_tokens=6, num_heads=3, head_dim=16,
                               dtype=torch.bfloat16, device=torch.device("cpu"), timeout_s=5.0,
                               config=CONFIG)
        epoch0 = int(b.ws.state[0])
        assert epoch0 >= 1, "warm-up ran no merge"
        views = {}
        for T in (1, 4, 6, 4, 1):  # a token count again: its views, holding the new result
            out = torch.randn(T, 3, 16).to(torch.bfloat16)
            lse = torch.randn(T, 3)
            got, got_lse = b(out, lse)
            ref, ref_lse = combine_torch(out[None], lse[None], torch.bfloat16)
            assert torch.equal(got.float(), ref.float()), "W=1 merge is not the identity"
            assert torch.allclose(got_lse, ref_lse)
            assert got.data_ptr() == b.res.data_ptr() and got_lse.data_ptr() == \
                b.res_lse.data_ptr(), "the result is not a view of the internal buffers"
            first = views.setdefault(T, (got, got_lse))
            assert first[0] is got and first[1] is got_lse, \
                f"T={T}: a new view object on a later call"
        assert int(b.ws.state[0]) == epoch0 + 5
        # The backend takes contiguous inputs and a contiguous fp32 base-e LSE as they are
        # (DcpBackend's contract); the merger converts what a caller hands it: a strided out,
        # a strided bf16 base-2 LSE.
        from attncomm.dcp import DcpMerger
        from attncomm.dcp.lse_merge.api import LN2
        m = DcpMerger(max_tokens=6, num_heads=3, head_dim=16, dtype=torch.bfloat16,
                      backend="reference", lse_base="2")
        m._impl = b
        out = torch.randn(3, 5, 16).to(torch.bfloat16).transpose(0, 1)
        lse2 = torch.randn(3, 5).to(torch.bfloat16).t()
        got, got_lse = m(out, lse2, return_lse=True)
        ref, ref_lse = combine_torch(out[None].contiguous(), (lse2.float() * LN2)[None],
                                     torch.bfloat16)
        assert torch.equal(got.float(), ref.float()), "strided out through the merger"
        assert torch.allclose(got_lse, ref_lse / LN2), "base-2 LSE through the merger"
        from attncomm import PeerTimeoutError
        b.ws.errors[0] = 1  # as a kernel's timed-out wait for peer 0 leaves it
        try:
            b.check()
            raise AssertionError("no PeerTimeoutError")
        except PeerTimeoutError as exc:
            assert exc.peer_ranks == [0], exc
        for _ in range(2):  # broken for good: every later call raises the same error
            try:
                b(out, lse)
                raise AssertionError("a broken workspace accepted a call")
            except PeerTimeoutError as exc:
                assert "unusable" in str(exc) and exc.peer_ranks == [0], exc
    finally:
        dist.destroy_process_group()


def main(argv) -> int:
    """``_symm_interp.py [STAGGER_MIN_BYTES STAGGER_SPLIT]``."""
    global CONFIG
    if argv:
        CONFIG = SymmConfig(stagger_min_bytes=int(argv[0]), stagger_split=int(argv[1]))
    for case in CASES:
        run_case(*case)
    run_backend_w1()
    print(f"ok {len(CASES)} cases + backend")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
