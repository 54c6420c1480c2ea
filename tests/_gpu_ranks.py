"""Shared by the GPU tests whose rank functions run on CUDA ranks (``cuda_pools`` or
``attncomm.launch(..., device="cuda")``): W ranks on W GPUs (NCCL) or W processes sharing fewer
GPUs (a gloo group: CUDA tensors must go through ``attncomm.collectives``, which stages them
through the host; gloo handed a CUDA tensor crashes the process). Everything here is correct for
both."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from attncomm import capability, collectives

__all__ = ["CAPTURE_MODES", "dev", "shared_gpu", "gather", "gather_rows", "capture"]

#: ``torch.cuda.graph``'s capture modes: torch's default ("global": any CUDA call of another
#: thread of the process, e.g. a watchdog's, during the capture breaks it) and "thread_local".
CAPTURE_MODES = ("global", "thread_local")


def dev() -> torch.device:
    """This rank's CUDA device (``torch.device("cuda", rank)`` does not exist on ranks that
    share a GPU)."""
    return torch.device("cuda", torch.cuda.current_device())


def shared_gpu(group=None) -> str | None:
    """Why ranks of ``group`` share a GPU (``"ranks 0, 1 share GPU 0"``), None when each rank
    has its own. Collective on its first call per group (the library's ``group_gpus``)."""
    return capability.group_gpus(group).shared_reason()


def gather(x: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's ``x`` stacked ``[W, *x.shape]`` (the same shape on every rank), through
    ``collectives.all_gather_tensor`` (NCCL, or gloo staged through the host). Moves bytes, so
    it is exact for any dtype (gloo has no bf16)."""
    world = dist.get_world_size(group)
    flat = x.contiguous().reshape(-1).view(torch.uint8)
    out = torch.empty(world * flat.numel(), dtype=torch.uint8, device=x.device)
    collectives.all_gather_tensor(out, flat, group=group)
    return out.view(x.dtype).view(world, *x.shape)


def gather_rows(x: torch.Tensor, lens: Sequence[int], dim: int = 1, group=None) -> torch.Tensor:
    """Every rank's ``x`` (rank r has ``lens[r]`` rows along ``dim``, the other dims equal)
    concatenated along ``dim`` in rank order: padded to ``max(lens)`` first, as an all_gather
    needs one size on every rank."""
    shape = list(x.shape)
    shape[dim] = max(lens)
    pad = x.new_zeros(shape)
    pad.narrow(dim, 0, x.shape[dim]).copy_(x)
    parts = gather(pad, group)
    return torch.cat([parts[r].narrow(dim, 0, n) for r, n in enumerate(lens)], dim)


def capture(fn: Callable[[], object], mode: str):
    """``fn()`` captured in a new CUDA graph with ``capture_error_mode=mode``: ``(graph, what
    fn returned inside the capture)`` (its tensors are the graph's outputs)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=mode):
        out = fn()
    return graph, out
