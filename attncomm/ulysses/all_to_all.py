"""The ``all_to_all`` transport: the process group's ``all_to_all_single`` with split sizes.

NCCL on GPU, gloo on CPU; uneven heads and sequences need no padding because every chunk has its
own split size. Data travels as bytes (gloo lacks some dtypes, e.g. bf16, for this collective).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import _dist, collectives
from .layout import ExchangePlan
from .transport import (Exchange, SendBuffer, Transport, dense_send_buffer, fill_send_buffer,
                        send_views, source_view)

__all__ = ["AllToAllTransport"]


class _A2AExchange(Exchange):
    def __init__(self, transport, work, plan, recv, out, dtype, device):
        self.t, self.work, self.plan = transport, work, plan
        self.recv, self.out, self.dtype, self.device = recv, out, dtype, device
        self._result = None

    def wait(self) -> torch.Tensor:
        if self._result is not None:
            return self._result
        if self.work is not None:
            if self.t.gloo:  # the host waits, bounded by timeout_s
                _dist.wait(self.work, self.t.group, "ulysses all_to_all", self.t.timeout_s)
            else:  # NCCL: the stream waits (graph-capturable), bounded by the group's timeout
                try:
                    self.work.wait()
                except RuntimeError:
                    with _dist.guard_timeout(self.t.group, "ulysses all_to_all",
                                             self.t.timeout_s):
                        raise
        r, plan = self.t.rank, self.plan
        if plan.tiled:
            if self.out is not None and self.out.data_ptr() != self.recv.data_ptr():
                # a tiled plan's pieces start at 0 and are dense: the prefix of the buffer
                self.out[:self.recv.numel()].copy_(self.recv)
                self._result = self.out
            else:
                self._result = self.recv
            return self._result
        final = self.out if self.out is not None else torch.empty(
            plan.recv_numel[r], dtype=self.dtype, device=self.device)
        _unpack(plan, r, self.recv, final)
        self._result = final
        return final


def _unpack(plan: ExchangePlan, r: int, recv: torch.Tensor, final: torch.Tensor) -> None:
    """Rank ``r``'s receive buffer (the pieces back to back in source order) into their places
    in ``final``: one strided copy when the pieces form a grid (``ExchangePlan.unpack_grid``:
    e.g. ``head_to_seq`` with every rank holding as many heads), else one copy per piece."""
    grid = plan.unpack_grid(r)
    if grid is not None:
        sizes, src_strides, dst_strides, off = grid
        final.as_strided(sizes, dst_strides, final.storage_offset() + off).copy_(
            recv.as_strided(sizes, src_strides, recv.storage_offset()))
        return
    pos = 0
    for s in range(plan.world_size):
        for x in plan.pieces[s][r]:
            dst = final.as_strided((x.rows, x.cols), (x.dst_pitch, 1),
                                   final.storage_offset() + x.dst_offset)
            dst.copy_(recv[pos:pos + x.numel].view(x.rows, x.cols))
            pos += x.numel


class AllToAllTransport(Transport):
    """``all_to_all_single`` over ``group`` (async; ``Exchange.wait`` blocks the stream or, on
    gloo, the host, bounded by ``timeout_s``). Its send buffer (``send_buffer``) is the
    ``all_to_all_single`` input itself; results never alias staging."""

    name = "all_to_all"

    def __init__(self, group, rank: int, world_size: int, timeout_s: float):
        super().__init__(group, rank, world_size, timeout_s)
        self.gloo = dist.get_backend(group) == "gloo"

    def start(self, plan: ExchangePlan, parts: Sequence[torch.Tensor], dtype: torch.dtype,
              device: torch.device, out: torch.Tensor | None = None, *,
              send: SendBuffer | None = None) -> Exchange:
        r, w = self.rank, self.world_size
        if w == 1:
            return self._local(plan, parts, dtype, device, out, send)
        if send is not None:
            self._validate_send(plan, dtype, send)
            send = send.flat
        else:
            send = self._pack(plan, parts, dtype, device)
        if plan.tiled and out is not None and plan.covers(r):
            recv = out
        else:
            recv = torch.empty(plan.recv_count(r), dtype=dtype, device=device)
        send_splits, recv_splits = plan.byte_splits(r, dtype.itemsize)
        try:
            work = collectives.all_to_all_single(_dist.as_bits(recv), _dist.as_bits(send),
                                                 recv_splits, send_splits, group=self.group,
                                                 async_op=True)
        except RuntimeError:
            with _dist.guard_timeout(self.group, "ulysses all_to_all", self.timeout_s):
                raise
        return _A2AExchange(self, work, plan, recv, out, dtype, device)

    def keeps_send_buffer(self, plan: ExchangePlan) -> bool:
        # ``_local``: a tiled plan's send buffer is its final buffer, returned as it is
        return self.world_size == 1 and plan.tiled

    def _local(self, plan, parts, dtype, device, out, send) -> Exchange:
        """A group of one: nothing to exchange. The caller's send buffer (fresh) is the final
        buffer of a tiled plan; otherwise each piece is copied to its final place once."""
        if send is not None:
            self._validate_send(plan, dtype, send)
            if plan.tiled and out is None:
                return _A2AExchange(self, None, plan, send.flat, None, dtype, device)
        final = out if out is not None else torch.empty(plan.recv_numel[0], dtype=dtype,
                                                        device=device)
        srcs = (send_views(send, 0) if send is not None else
                [(x, source_view(parts, x)) for x in plan.pieces[0][0]])
        for x, src in srcs:
            final.as_strided((x.rows, x.cols), (x.dst_pitch, 1),
                             final.storage_offset() + x.dst_offset).copy_(src)
        done = _A2AExchange(self, None, plan, final, None, dtype, device)
        done._result = out if out is not None else final
        return done

    def _pack(self, plan: ExchangePlan, parts, dtype, device) -> torch.Tensor:
        r = self.rank
        direct = _direct_send(plan, parts, r)
        if direct is not None:
            return direct
        buf = dense_send_buffer(plan, dtype, device, r)
        fill_send_buffer(buf, parts)
        return buf.flat


def _direct_send(plan: ExchangePlan, parts, r: int) -> torch.Tensor | None:
    """The send buffer as a view of the source when the pieces, in send order, are consecutive
    dense rows of one contiguous part (e.g. ``head_to_seq`` with ``B = 1``; found once per
    plan and source strides: ``ExchangePlan.send_span``); else None."""
    x = parts[0]
    span = plan.send_span(r, x.stride())
    if span is None:
        return None
    first, total = span
    return x.as_strided((total,), (1,), x.storage_offset() + first)
