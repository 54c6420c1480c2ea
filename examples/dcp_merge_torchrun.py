"""DCP merge from an engine's own processes: run under torchrun, check against one process.

    torchrun --nproc-per-node 2 examples/dcp_merge_torchrun.py            # GPUs: NCCL
    torchrun --nproc-per-node 2 examples/dcp_merge_torchrun.py --device cpu   # gloo on CPU

What an engine does: torchrun starts the ranks and sets RANK, WORLD_SIZE, LOCAL_RANK and the
rendezvous address; the engine initialises torch.distributed itself (on GPUs: one device per
rank, ``torch.cuda.set_device`` before ``init_process_group``); attncomm's calls then run on
the default group (or a group passed as ``group=``). attncomm.launch is not involved.

Each rank holds one shard of the keys and values (decode context parallelism). It computes
attention of every query head over its shard alone, giving a partial output ``[T, H, D]`` and
its log-sum-exp ``[T, H]``; ``dcp.merge`` combines the partials of all ranks and returns this
rank's slice of heads ``[T, H/W, D]``. Every rank checks its slice against attention over the
whole key/value set computed in one process in fp64; rank 0 prints one PASS or FAIL line and
the exit code is 0 only on PASS.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from attncomm import dcp

T, H, D, S_PER_RANK = 5, 8, 32, 24  # queries, heads (H % W == 0), head dim, keys per rank


def partial_attention(q, k, v):
    """Attention of ``q [T, H, D]`` over ``k, v [S, H, D]``: ``(out [T, H, D], lse [T, H])``."""
    scores = torch.einsum("thd,shd->hts", q, k) / D ** 0.5          # [H, T, S]
    lse = torch.logsumexp(scores, dim=-1)                            # [H, T]
    out = torch.einsum("hts,shd->thd", torch.exp(scores - lse[..., None]), v)
    return out, lse.transpose(0, 1).contiguous()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto (default): cuda when a GPU is visible, else cpu")
    args = p.parse_args()
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        # Every rank draws the same full problem (one seed) and keeps its own key/value shard.
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(T, H, D, generator=gen, dtype=torch.float64)
        k = torch.randn(world * S_PER_RANK, H, D, generator=gen, dtype=torch.float64)
        v = torch.randn(world * S_PER_RANK, H, D, generator=gen, dtype=torch.float64)
        shard = slice(rank * S_PER_RANK, (rank + 1) * S_PER_RANK)
        out, lse = partial_attention(q.float(), k[shard].float(), v[shard].float())

        mine = dcp.merge(out.to(device), lse.to(device))              # [T, H/W, D]

        ref, _ = partial_attention(q, k, v)                          # one process, fp64
        heads = slice(rank * H // world, (rank + 1) * H // world)
        err = torch.tensor([(mine.cpu().double() - ref[:, heads]).abs().max().item()],
                           device=device)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        tol = 1e-5
        ok = bool(err.item() <= tol) and tuple(mine.shape) == (T, H // world, D)
        if rank == 0:
            print(f"dcp_merge_torchrun: {'PASS' if ok else 'FAIL'}: W={world} on "
                  f"{'cuda (nccl)' if use_cuda else 'cpu (gloo)'}, each rank's [T, H/W, D] = "
                  f"{list(mine.shape)} against one process, fp64 reference: max |error| "
                  f"{err.item():.2e} (tolerance {tol:g})", flush=True)
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
