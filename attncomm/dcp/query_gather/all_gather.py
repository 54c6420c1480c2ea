"""``all_gather``: the DCP query gather over the process group's ``all_gather_into_tensor``."""
from __future__ import annotations

import torch

from ..._dist import as_bits, wait
from ...collectives import all_gather_tensor
from .backend import GATHER_REGISTRY, QueryGatherBackend
from .query_math import quantize_e4m3, rotate_tail

__all__ = ["AllGatherBackend"]


@GATHER_REGISTRY.register
class AllGatherBackend(QueryGatherBackend):
    """Rotate into a send buffer, ``all_gather_into_tensor`` into ``[W, T, H/W, D]`` staging
    (payload as bytes: every process-group backend moves uint8), permute into ``out`` (or the
    caller's ``into``). One token gathers straight into the result (its rank order is the
    result's layout); one rank rotates straight into it.

    The result is a view of ``out [max_tokens, H, D]``, local memory that only this rank's
    stream writes: valid until this rank's next call. Graph-capturable on NCCL. FP8: the slice
    is rotated into an fp32 scratch and quantized (``quantize_e4m3``) into the send buffer, so
    one byte per value crosses the wire.
    """

    name = "all_gather"

    def __init__(self, group, **kw):
        super().__init__(group, **kw)
        W, n, h, D = self.world_size, self.max_tokens, self.hs, self.head_dim
        od = self.out_dtype
        self.send = torch.empty((n, h, D), dtype=od, device=self.device)
        self.stage = torch.empty((W * n * h * D,), dtype=od, device=self.device)
        self.out = torch.empty((n, W * h, D), dtype=od, device=self.device)
        self.f32 = (torch.empty((n, h, D), dtype=torch.float32, device=self.device)
                    if self.fp8 else None)

    def _fill_send(self, q, cos, sin, send):
        if self.fp8:
            x = self.f32[:q.shape[0]]
            if cos is not None:
                rotate_tail(q, cos, sin, out=x)
            else:
                x.copy_(q)
            r = self.rank * self.hs
            quantize_e4m3(x, self.q_scale[r:r + self.hs], out=send)
        elif cos is not None:
            rotate_tail(q, cos, sin, out=send)
        else:
            send.copy_(q)

    def __call__(self, q, cos, sin, into=None):
        T, h, D = q.shape
        W = self.world_size
        out = self.out[:T] if into is None else into
        if W == 1:  # the slice is the whole result: rotated (or copied) straight into it
            self._fill_send(q, cos, sin, out)
            return out
        send = self.send[:T]
        self._fill_send(q, cos, sin, send)
        # One token: rank order [W, 1, H/W, D] is already [1, H, D]: no staging, no permute.
        stage = out.view(-1) if T == 1 else self.stage[:W * T * h * D]
        work = all_gather_tensor(as_bits(stage), as_bits(send.view(-1)), self.group,
                                 async_op=True)
        wait(work, self.group, "dcp.gather[all_gather]", self.timeout_s)
        if T > 1:
            out.view(T, W, h, D).copy_(stage.view(W, T, h, D).transpose(0, 1))
        return out
