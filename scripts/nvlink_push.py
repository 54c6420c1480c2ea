"""Ceilings under the symm_a2a DCP merge on W GPUs: every rank pushes N bytes to every peer with
SM stores (Triton) into torch SymmetricMemory, all directions at once, in CUDA graphs.

Rows, per payload size and grid:
- ``push``: stores only (no fence, no flag): the link rate of SM stores;
- ``push+flag``: stores, then per program one release (sys) flag per peer, then an acquire wait
  for every peer's flag: the smallest complete exchange, i.e. the merge without its combine;
- ``ce``: a copy-engine copy of the same bytes into the peer (``Tensor.copy_``), one direction per
  rank, both ranks at once, no signal.

    python scripts/nvlink_push.py [--world-size 2] [--mib 0.5 1 2 4] [--grids 32 64 128]
        [--json PATH]

Every grid must fit on the GPU at once (≤ its SM count): the programs spin on each other.
Times are slowest-rank medians of graph replays / 10, µs; GB/s counts the bytes one rank sends to
one peer. Compare ``push+flag`` at 4 MiB with ``attncomm bench dcp`` at 128 tokens (64 heads ×
512 bf16 at W=2 moves 4 MiB per peer): the difference is what the combine and the epoch cost.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@triton.jit
def _push_kernel(src, slab, delta, flags, count_ptr, err_ptr, n_rows, timeout_ns, D,
                 RANK: tl.constexpr, W: tl.constexpr, FLAG: tl.constexpr, BR: tl.constexpr,
                 BD: tl.constexpr):
    # src [n_rows, D] bf16 → every peer's data rows [RANK*n_rows + r] (this source's cell);
    # peer addresses are local ones + delta[q] · 32 bytes.
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    d = tl.arange(0, BD)
    b = pid
    while b * BR < n_rows:
        rows = b * BR + tl.arange(0, BR)
        m2 = (rows < n_rows)[:, None] & (d < D)[None, :]
        v = tl.load(src + rows[:, None] * D + d[None, :], mask=m2)
        for q in tl.static_range(W):
            if q != RANK:
                dst = slab + tl.load(delta + q) * 16 + (RANK * n_rows + rows)[:, None] * D
                tl.store(dst + d[None, :], v, mask=m2)
        b += G
    if FLAG:
        # per program: its own call counter (private), +1 into every peer's flag[RANK, pid]
        c = tl.load(count_ptr + pid) + 1
        tl.debug_barrier()
        for q in tl.static_range(W):
            if q != RANK:
                pf = flags + tl.load(delta + q) * 8 + RANK * G + pid
                tl.atomic_xchg(pf, c, sem="release", scope="sys")
        for q in tl.static_range(W):
            if q != RANK:
                pw = flags + q * G + pid
                v = tl.atomic_add(pw, 0, sem="acquire", scope="sys")
                t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [],
                                               dtype=tl.int64, is_pure=False, pack=1)
                while v < c:  # counters only grow (a fast peer may be at c + 1 already)
                    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [],
                                                    dtype=tl.int64, is_pure=False, pack=1)
                    if now - t0 > timeout_ns:
                        tl.atomic_xchg(err_ptr + q, 1)
                        v = c
                    else:
                        v = tl.atomic_add(pw, 0, sem="acquire", scope="sys")
        tl.store(count_ptr + pid, c)


def _rank(rank, world_size, cfg):
    import torch.distributed._symmetric_memory as symm_mem

    from attncomm import cpu_group
    from attncomm.bench.common import slowest_rank_median, time_graph

    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    D = 512
    max_rows = int(max(cfg["mib"]) * 2 ** 20) // (D * 2)
    max_grid = max(cfg["grids"])
    data_bytes = world_size * max_rows * D * 2
    flag_bytes = world_size * max_grid * 4
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # needed on older torch, deprecated (a no-op) on newer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable(group.group_name)
    slab = symm_mem.empty(data_bytes + flag_bytes, dtype=torch.uint8, device=dev)
    slab.zero_()
    torch.cuda.synchronize()
    handle = symm_mem.rendezvous(slab, group)
    ptrs = [int(p) for p in handle.buffer_ptrs]
    delta = torch.tensor([(p - ptrs[rank]) // 32 for p in ptrs], dtype=torch.int64, device=dev)
    assert all((p - ptrs[rank]) % 32 == 0 for p in ptrs)
    data = slab[:data_bytes].view(torch.bfloat16)
    flags = slab[data_bytes:].view(torch.int32)
    err = torch.zeros(world_size, dtype=torch.int32, device=dev)
    g = cpu_group()
    records = []
    for mib in cfg["mib"]:
        n_rows = int(mib * 2 ** 20) // (D * 2)
        def make_src(r):
            gen = torch.Generator(device=dev).manual_seed(1000 * r + int(mib * 64))
            return torch.randn(n_rows, D, device=dev, generator=gen).to(torch.bfloat16)

        src = make_src(rank)
        for grid in cfg["grids"]:
            for flag in (0, 1):
                count = torch.zeros(grid, dtype=torch.int32, device=dev)
                flags.zero_()
                torch.cuda.synchronize()
                dist.barrier(group=g)
                br = 64 if n_rows >= 64 * grid else max(1, triton.next_power_of_2(
                    -(-n_rows // grid)))

                def fn():
                    _push_kernel[(grid,)](src, data, delta, flags, count, err, n_rows,
                                          10 ** 9 * 10, D, RANK=rank, W=world_size, FLAG=flag,
                                          BR=br, BD=D, num_warps=16 if br >= 32 else 8)

                data.view(-1)[: world_size * max_rows * D].fill_(float("nan"))
                t = slowest_rank_median(time_graph(fn, barrier=lambda: dist.barrier(group=g),
                                                   back_to_back=True))
                torch.cuda.synchronize()
                if int(err.sum()):
                    raise RuntimeError(f"rank {rank}: flag wait timed out (grid {grid})")
                for q in range(world_size):  # what arrived from every peer is exactly its src
                    if q != rank:
                        got = data.view(-1)[q * n_rows * D:(q + 1) * n_rows * D]
                        if not torch.equal(got.view(torch.int16),
                                           make_src(q).view(-1).view(torch.int16)):
                            raise AssertionError(f"rank {rank}: rows from {q} differ "
                                                 f"({mib} MiB, grid {grid}, flag {flag})")
                records.append({"what": "push+flag" if flag else "push", "mib": mib,
                                "grid": grid, "us": round(t, 3),
                                "gbps": round(mib * 2 ** 20 / (t * 1e-6) / 1e9, 1)})
        if world_size == 2:
            peer = 1 - rank
            dst = handle.get_buffer(peer, (n_rows, D), torch.bfloat16,
                                    storage_offset=rank * n_rows * D)
            t = slowest_rank_median(time_graph(lambda: dst.copy_(src), barrier=lambda:
                                               dist.barrier(group=g), back_to_back=True))
            records.append({"what": "ce", "mib": mib, "grid": 0, "us": round(t, 3),
                            "gbps": round(mib * 2 ** 20 / (t * 1e-6) / 1e9, 1)})
    return records if rank == 0 else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--mib", type=float, nargs="+", default=[0.5, 1, 2, 4])
    p.add_argument("--grids", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from attncomm import config, launch
    config.force_safe_env()
    from attncomm.bench.common import meta
    res = launch(_rank, a.world_size, device="cuda",
                 args=({"mib": a.mib, "grids": a.grids},))
    recs = res[0]
    print(f"{'what':>10} {'MiB':>5} {'grid':>5} {'µs':>8} {'GB/s':>7}")
    for r in recs:
        print(f"{r['what']:>10} {r['mib']:>5} {r['grid']:>5} {r['us']:>8.2f} {r['gbps']:>7.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta("cuda", a.world_size), "records": recs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
