"""The tensor collectives library code runs, for any tensors on any process group.

The one place attncomm calls torch.distributed's tensor collectives (``all_gather``,
``reduce_scatter``, ``all_to_all_single``, ``all_reduce``, ``broadcast``, point-to-point), so
that one rule holds everywhere: **gloo never sees a device pointer.** A gloo group takes CPU
tensors only; handed a CUDA tensor it passes the device address to its TCP writes, which fault
on it and bring the process down ("writev ... Bad address"). Ranks that share a GPU have a
gloo group (NCCL refuses two ranks on one device), and their CUDA tensors travel through the
host: each input is copied into a CPU tensor, gloo runs on the copies, and each output is
copied back when the work is waited for (``StagedWork``). The copies move bytes, so every
collective that moves data (all_gather, all_to_all, broadcast, point-to-point) gives the bits
the NCCL path gives; a reduction sums in gloo's order.

Staging makes the host wait for the GPU (the device-to-host copy), so it cannot be captured in
a CUDA graph: every function here raises ``RuntimeError`` when it would stage inside a capture
(on shared-GPU ranks the peer-mapped backends, ``symm_a2a``, the gather's ``symm`` and Ulysses
``ce``, are the ones to capture).

Also the version shims for collectives renamed between torch 2.11 and 2.13
(``all_gather_single`` / ``all_gather_into_tensor``, ``reduce_scatter_single`` /
``reduce_scatter_tensor``).

Dependency direction: the substrate's bottom (imports torch only); ``_dist`` and every exchange
import it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["needs_host", "StagedWork", "all_gather_tensor", "reduce_scatter_tensor",
           "all_to_all_single", "all_reduce", "broadcast", "batch_isend_irecv", "gather_sequence"]

#: Tests only: stage every collective of a gloo group, CPU tensors too (the copies are then CPU
#: to CPU), so that the staging itself runs in CI without a GPU.
_STAGE_CPU = False


#: ``group → its backend is gloo``, keyed by the group object (held: never a reused id): the
#: check costs a dict lookup on the hot path instead of ``dist.get_backend``.
_GLOO: dict = {}


def needs_host(group, *tensors: torch.Tensor) -> bool:
    """Whether a collective of ``tensors`` on ``group`` must go through host copies: the group
    is gloo and some tensor is not on the CPU."""
    if not _STAGE_CPU and all(t.device.type == "cpu" for t in tensors):
        return False
    g = group if group is not None else dist.group.WORLD
    gloo = _GLOO.get(g)
    if gloo is None:
        gloo = _GLOO[g] = dist.get_backend(g) == "gloo"
    return gloo


class StagedWork:
    """The work of a staged collective: ``wait()`` waits for gloo's work on the host copies,
    then copies each result into its destination tensor (once). ``wait(timeout)`` takes the
    ``timedelta`` gloo's works take; ``is_completed()`` is True once ``wait()`` has copied the
    results back."""

    def __init__(self, work, copies: list[tuple[torch.Tensor, torch.Tensor]]):
        self.work = work
        self.copies = copies

    def wait(self, timeout=None) -> bool:
        if self.work is not None:
            if timeout is None:
                self.work.wait()
            else:
                self.work.wait(timeout)
        copies, self.copies = self.copies, []
        for dst, src in copies:
            dst.copy_(src)
        return True

    def is_completed(self) -> bool:
        return not self.copies and (self.work is None or self.work.is_completed())


def _host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``t`` (the host waits for the work that produced ``t``)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def _refuse_capture(tensors: Sequence[torch.Tensor], op: str) -> None:
    if any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"attncomm: {op} of CUDA tensors over a gloo group (ranks that share a GPU) goes "
            f"through host copies, which a CUDA graph cannot capture; inside a graph use a "
            f"peer-mapped backend (dcp symm_a2a, the gather's symm, ulysses ce)")


def _staged(op: str, run, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
            async_op: bool):
    """Run ``run(host_inputs, host_outputs, async_op)`` on host copies; copy the host outputs
    back now (``async_op=False``) or at the returned work's ``wait()``. An output that is also
    an input (an in-place collective) shares one host copy."""
    _refuse_capture([*inputs, *outputs], op)
    host_in = [_host(t) for t in inputs]
    host_out = []
    for t in outputs:
        same = next((h for i, h in zip(inputs, host_in) if i is t), None)
        host_out.append(same if same is not None else torch.empty(t.shape, dtype=t.dtype))
    work = run(host_in, host_out, async_op)
    staged = StagedWork(work if async_op else None, list(zip(outputs, host_out)))
    if async_op:
        return staged
    staged.wait()
    return None


def all_gather_tensor(output: torch.Tensor, input: torch.Tensor, group=None,
                      async_op: bool = False):
    """``output [W·n, ...]`` ← every rank's ``input [n, ...]`` in rank order (torch 2.13 calls
    it ``all_gather_single``, torch 2.11 ``all_gather_into_tensor``). Returns the work handle
    when ``async_op``."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if needs_host(group, output, input):
        return _staged("all_gather", lambda i, o, a: fn(o[0], i[0], group=group, async_op=a),
                       [input], [output], async_op)
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None,
                          async_op: bool = False):
    """``output [n, ...]`` ← rank r's chunk of the sum over ranks of ``input [W·n, ...]``
    (``reduce_scatter_single`` / ``reduce_scatter_tensor``)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if needs_host(group, output, input):
        return _staged("reduce_scatter", lambda i, o, a: fn(o[0], i[0], group=group,
                                                            async_op=a),
                       [input], [output], async_op)
    return fn(output, input, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None, group=None,
                      async_op: bool = False):
    """``dist.all_to_all_single`` (split sizes along dim 0, None: equal chunks)."""
    if needs_host(group, output, input):
        return _staged("all_to_all", lambda i, o, a: dist.all_to_all_single(
            o[0], i[0], output_split_sizes, input_split_sizes, group=group, async_op=a),
            [input], [output], async_op)
    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                  group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """``dist.all_reduce`` of ``tensor`` in place."""
    if needs_host(group, tensor):
        return _staged("all_reduce", lambda i, o, a: dist.all_reduce(i[0], op=op, group=group,
                                                                     async_op=a),
                       [tensor], [tensor], async_op)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    """``dist.broadcast`` of ``tensor`` from global rank ``src``, in place."""
    if needs_host(group, tensor):
        return _staged("broadcast", lambda i, o, a: dist.broadcast(i[0], src=src, group=group,
                                                                   async_op=a),
                       [tensor], [tensor], async_op)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def batch_isend_irecv(ops: Sequence[dist.P2POp]) -> list:
    """``dist.batch_isend_irecv(ops)``: the works, one per op on gloo. On a gloo group with
    CUDA tensors each send goes out of a host copy and each receive lands in one, copied into
    its tensor when that op's work is waited for."""
    if not ops or not needs_host(ops[0].group, *(o.tensor for o in ops)):
        return dist.batch_isend_irecv(list(ops))
    _refuse_capture([o.tensor for o in ops], "point-to-point")
    host_ops, backs = [], []
    for o in ops:
        recv = o.op is dist.irecv
        h = torch.empty(o.tensor.shape, dtype=o.tensor.dtype) if recv else _host(o.tensor)
        host_ops.append(dist.P2POp(o.op, h, o.peer, o.group, o.tag))
        backs.append([(o.tensor, h)] if recv else [])
    works = dist.batch_isend_irecv(host_ops)
    return [StagedWork(w, b) for w, b in zip(works, backs)]


def gather_sequence(x: torch.Tensor, seq_lens: Sequence[int], group=None,
                    wait=None) -> torch.Tensor:
    """Every rank's ``[B, S_r, ...]`` shard (``seq_lens[r]`` rows on rank r) → the whole
    ``[B, S, ...]`` in rank order, on every rank: one all_gather of shards padded to
    ``max(S_r)``. A bool tensor travels as its bytes. ``wait``: None (a blocking all_gather) or
    a function given the async work that waits for it (e.g. ``_dist.wait`` with its timeout)."""
    w = len(seq_lens)
    if w == 1:
        return x
    if x.dtype == torch.bool:
        return gather_sequence(x.view(torch.uint8), seq_lens, group, wait).view(torch.bool)
    b, s_r, rest = x.shape[0], x.shape[1], tuple(x.shape[2:])
    m = max(seq_lens)
    pad = x.new_zeros(b, m, *rest)
    pad[:, :s_r] = x
    out = x.new_empty(w * pad.numel())
    if wait is None:
        all_gather_tensor(out, pad.reshape(-1), group=group)
    else:
        wait(all_gather_tensor(out, pad.reshape(-1), group=group, async_op=True))
    out = out.view(w, b, m, *rest)
    return torch.cat([out[r, :, :seq_lens[r]] for r in range(w)], dim=1)
