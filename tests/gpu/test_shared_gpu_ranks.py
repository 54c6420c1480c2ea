"""CUDA ranks that may share one GPU (``cuda_pools``: a GPU each over NCCL where there are
enough, else W processes on one GPU over gloo, peers mapped by CUDA IPC): the placement and the
peer mapping the ranks see; the caller's own collectives on the same group between library
calls (W = 2, 3, 4, uneven heads, sizes that change per call), every call bitwise against a
reference built from the gathered inputs; USP (U = 2 × R = 2) with Ulysses over ``ce`` against
``all_to_all`` and fp64; ``torch.compile(mode="reduce-overhead")`` of the merge, a
``DcpMerger`` and a ``UlyssesAttention(backend="ce")`` layer at W = 2, bit for bit equal to
eager. Run on the device: ``pytest -m gpu tests/gpu``."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _gpu_ranks import dev, gather, gather_rows, shared_gpu
from _reference import ref_merge
from _ring_helpers import bits_equal, ref_attention_lse

from attncomm import capability, collectives, dcp, ulysses
from attncomm.ulysses.layout import head_offsets
from attncomm.usp import USPAttention, make_groups, usp_positions

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1)]


# ------------------------------------------------------------------------------ placement
def _layout(rank, world):
    m = capability.peer_mapping(None)
    merger = dcp.DcpMerger(max_tokens=8, num_heads=4 * world, head_dim=64,
                           dtype=torch.bfloat16, backend="symm_a2a")
    out = (dist.get_backend(), shared_gpu(), m.kind, m.why, merger._impl.ws.mapping,
           torch.cuda.current_device(), merger.device.index)
    merger.close()
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_placement_and_peer_mapping(cuda_pools, world):
    pool = cuda_pools.get(world)
    res = cuda_pools.run(world, _layout, timeout_s=120)
    assert len({r[:4] for r in res}) == 1, res  # one verdict on every rank
    for rank, (backend, shared, kind, why, ws_kind, current, merger_gpu) in enumerate(res):
        assert current == merger_gpu == pool.gpus[rank], (rank, res, pool.gpus)
        assert ws_kind == kind, res
        if pool.shared_gpu:
            assert backend == "gloo" and shared is not None and kind == "ipc", res
        else:
            assert backend == "nccl" and shared is None, res
            assert kind == "torch" or "unavailable" in why, res


# ------------------------------------------------------------------------------ caller's own
def _interleaved(rank, world, seed, calls):
    """Library calls (ce exchanges with uneven heads and rows, a symm_a2a merge) with the
    caller's own collectives on the same group between them, of sizes that differ from the
    library's messages and from call to call; every result checked against a reference from
    the gathered inputs, so a collective the library left in flight (or posted from another
    thread) would meet the caller's and fail."""
    d = dev()
    H = 8  # 4, 4 at W = 2; 3, 3, 2 at W = 3; 2 each at W = 4
    lens = [3 + 2 * r for r in range(world)]
    heads = ulysses.head_split(H, world)
    lo = head_offsets(heads)[rank]
    hm = 4 * world
    merger = dcp.DcpMerger(max_tokens=8, num_heads=hm, head_dim=64, dtype=torch.bfloat16,
                           backend="symm_a2a")
    bad = []
    for i in range(calls):
        g = torch.Generator(device=d).manual_seed(seed * 1000 + 10 * i + rank)
        x = torch.randn((1, lens[rank], H, 64), generator=g, device=d).to(torch.bfloat16)
        y = ulysses.seq_to_head(x, seq_lens=lens, backend="ce")
        # the caller's own: a gather of a size of this call's (the same on every rank)
        tag = torch.full((3 + i,), float(100 * rank + i), device=d)
        tags = gather(tag)
        if tags[:, 0].tolist() != [float(100 * r + i) for r in range(world)] \
                or not torch.equal(tags, tags[:, :1].expand(-1, 3 + i)):
            bad.append(f"caller's gather after seq_to_head {i}")
        full = gather_rows(x, lens, dim=1)  # every rank's rows (padded: one size for gloo)
        if not bits_equal(y, full[:, :, lo:lo + heads[rank]]):
            bad.append(f"seq_to_head[ce] call {i} vs the gathered inputs")
        if not bits_equal(y, ulysses.seq_to_head(x, seq_lens=lens, backend="all_to_all")):
            bad.append(f"seq_to_head[ce] call {i} vs all_to_all")
        back = ulysses.head_to_seq(y, num_heads=H, seq_lens=lens, backend="ce")
        total = torch.full((2 + i % 3,), float(rank + 1), device=d)
        collectives.all_reduce(total)  # the caller's own, between two library calls
        if total.tolist() != [world * (world + 1) / 2] * (2 + i % 3):
            bad.append(f"caller's all_reduce after head_to_seq {i}: {total.tolist()}")
        if not bits_equal(back, x):
            bad.append(f"head_to_seq[ce] call {i}")
        T = 1 + (3 * i) % 8
        out = torch.randn((T, hm, 64), generator=g, device=d).to(torch.bfloat16)
        lse = torch.randn((T, hm), generator=g, device=d) * 2
        got = merger(out, lse).clone()
        src = torch.full((1 + i,), float(rank), device=d)
        collectives.broadcast(src, src=i % world)
        if src.tolist() != [float(i % world)] * (1 + i):
            bad.append(f"caller's broadcast after merge {i}")
        hs = hm // world
        sl = slice(rank * hs, (rank + 1) * hs)
        ref, _ = ref_merge(gather(out)[:, :, sl], gather(lse)[:, :, sl])
        err = ((got.double() - ref).abs() - 1.2e-2 * ref.abs()).max().item()
        if not err <= 1.2e-2:
            bad.append(f"merge[symm_a2a] call {i}: error {err}")
    torch.cuda.synchronize()
    merger.check()
    merger.close()
    return bad


@pytest.mark.parametrize("world", [2, 3, 4])
def test_callers_own_collectives_between_calls(cuda_pools, world, seed):
    for r, bad in enumerate(cuda_pools.run(world, _interleaved, seed, 6, timeout_s=240)):
        assert bad == [], f"seed {seed}: W={world} rank {r}: {bad}"


# ------------------------------------------------------------------------------ USP
_GRIDS: dict = {}  # rank side: (U, R) → this rank's groups, made once per pool


def _usp(rank, world, seed):
    """USP on a 2 × 2 grid (Ulysses groups of consecutive ranks, strided rings), both layouts,
    causal or not: Ulysses over ``ce`` bitwise equal to ``all_to_all`` (the ring's part is the
    same), and within bf16 rounding of fp64 attention over the whole sequence."""
    u, r = 2, 2
    if (u, r) not in _GRIDS:
        _GRIDS[(u, r)] = make_groups(u, r)
    ug, rg = _GRIDS[(u, r)]
    d = dev()
    b, hq, hkv, hd, s = 1, 8, 4, 64, 256
    g = torch.Generator().manual_seed(seed)  # the whole sequence, the same on every rank
    q, k, v = (torch.randn((b, s, h, hd), generator=g).to(torch.bfloat16)
               for h in (hq, hkv, hkv))
    eps = torch.finfo(torch.bfloat16).eps
    vmax = v.double().abs().max().item()
    bad = []
    for layout in ("contiguous", "zigzag"):
        pos = usp_positions(s, u, r, rank, layout)
        loc = [t[:, pos].contiguous().to(d) for t in (q, k, v)]
        for causal in (False, True):
            outs = {}
            for backend in ("ce", "all_to_all"):
                mod = USPAttention(ulysses_group=ug, ring_group=rg, layout=layout,
                                   backend=backend, pipeline_groups=0)
                outs[backend] = mod(*loc, causal=causal)
                if backend == "ce" and set(mod.last_backends.values()) != {"ce"}:
                    bad.append((layout, causal, "backends", mod.last_backends))
                mod.close()
            if not bits_equal(outs["ce"], outs["all_to_all"]):
                bad.append((layout, causal, "ce differs from all_to_all"))
            ref = ref_attention_lse(q, k, v, causal)[0][:, pos]
            got = outs["ce"].cpu().double()
            over = ((got - ref).abs() - eps * (ref.abs() + vmax)).max().item()
            if over > 0:
                bad.append((layout, causal, "vs fp64", over))
    torch.cuda.synchronize()
    return bad


def test_usp_ce_2x2(cuda_pools, seed):
    for rank, bad in enumerate(cuda_pools.run(4, _usp, seed, timeout_s=240)):
        assert not bad, f"seed {seed}: rank {rank}: {bad}"


# ------------------------------------------------------------------------------ compile
def _refill(seed, rep, rank, tensors):
    g = torch.Generator(device=dev()).manual_seed(seed * 1000 + 10 * rep + rank)
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=g, device=t.device).to(t.dtype))


def _compiled(rank, world, seed):
    """After an eager warm-up of each shape: ``torch.compile(mode="reduce-overhead",
    fullgraph=True)`` (inductor's CUDA graphs) of ``dcp.merge(backend="symm_a2a")``, of a
    ``DcpMerger(backend="symm_a2a")`` call and of a layer with ``UlyssesAttention(backend="ce")``
    and the ce round trip; fresh inputs each run, outputs bit for bit equal to eager."""
    d, bf = dev(), torch.bfloat16
    g = torch.Generator(device=d).manual_seed(seed * 10 + rank)
    H, D, T = 8 * world, 128, 8
    out = torch.randn((T, H, D), generator=g, device=d).to(bf)
    lse = torch.randn((T, H), generator=g, device=d) * 3
    merger = dcp.DcpMerger(max_tokens=16, num_heads=H, head_dim=D, dtype=bf, backend="symm_a2a")
    hq, hkv, hd, s_r = 4 * world, 2 * world, 64, 256
    q, k, v = (torch.randn((1, s_r, h, hd), generator=g, device=d).to(bf)
               for h in (hq, hkv, hkv))
    cos, sin = (torch.randn((s_r * world, hd), generator=g, device=d) for _ in range(2))
    mod = ulysses.UlyssesAttention(backend="ce", pipeline_groups=2)

    def merge_fn(o, l):
        return dcp.merge(o, l, backend="symm_a2a", return_lse=True)

    def merger_fn(o, l):
        return merger(o, l, return_lse=True)

    def layer(q, k, v, cos, sin):
        y = ulysses.seq_to_head(q, backend="ce")
        return mod(q, k, v, rope=(cos, sin)), ulysses.head_to_seq(y, num_heads=hq, backend="ce")

    cases = {"dcp.merge[symm_a2a]": (merge_fn, (out, lse)),
             "DcpMerger[symm_a2a]": (merger_fn, (out, lse)),
             "UlyssesAttention[ce] + round trip": (layer, (q, k, v, cos, sin))}
    res = {}
    for name, (fn, args) in cases.items():
        fn(*args)  # the eager warm-up of every shape
        torch.cuda.synchronize()
        torch._dynamo.reset()
        try:
            compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
            bad = []
            for rep in range(4):  # warm-up run, recording, replays
                _refill(seed, rep, rank, args)
                got = [t.clone() for t in compiled(*args)]
                want = fn(*args)
                if not all(bits_equal(a, b) for a, b in zip(got, want)):
                    bad.append(rep)
                if fn is layer and not bits_equal(got[1], args[0]):
                    bad.append(f"round trip {rep}")
            res[name] = "equal" if not bad else f"differs at {bad}"
        except Exception as exc:  # noqa: BLE001 - the row says what failed
            res[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    torch.cuda.synchronize()
    merger.check()
    torch._dynamo.reset()
    return res


def test_reduce_overhead_compile_of_exchanges(cuda_pools, seed):
    for rank, res in enumerate(cuda_pools.run(2, _compiled, seed, timeout_s=240)):
        bad = {name: v for name, v in res.items() if v != "equal"}
        assert not bad, f"seed {seed}: rank {rank}: {bad}"
