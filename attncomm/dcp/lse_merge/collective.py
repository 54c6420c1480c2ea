"""The DCP merge over plain torch.distributed collectives: ``reference``, ``ag_rs`` and ``a2a``.

Each backend allocates per call (so it is graph-capturable through torch's graph memory pool)
and moves fp16/bf16/fp32 payloads as same-width integers, which every process-group backend
(gloo included) supports.
"""
from __future__ import annotations

import torch

from ..._dist import as_bits, wait
from ...collectives import all_gather_tensor, all_to_all_single, reduce_scatter_tensor
from .backend import MERGE_REGISTRY, DcpBackend
from .combine import combine, scale_own

__all__ = ["ReferenceBackend", "AgRsBackend", "A2ABackend"]


@MERGE_REGISTRY.register
class ReferenceBackend(DcpBackend):
    """all_gather every partial output and LSE, merge everything locally, keep the head slice.

    Moves W× the data of the other backends; it is the simplest correct merge over a group.
    """

    name = "reference"

    def __call__(self, out, lse, res=None, res_lse=None):
        W, r = self.world_size, self.rank
        T, H, D = out.shape
        hs = H // W
        outs = torch.empty((W * T, H, D), dtype=out.dtype, device=out.device)
        lses = torch.empty((W * T, H), dtype=torch.float32, device=out.device)
        wait(all_gather_tensor(as_bits(outs), as_bits(out), self.group, async_op=True), self.group,
             "dcp.merge[reference] all_gather outputs", self.timeout_s)
        wait(all_gather_tensor(lses, lse, self.group, async_op=True), self.group,
             "dcp.merge[reference] all_gather LSE", self.timeout_s)
        sl = slice(r * hs, (r + 1) * hs)
        return combine(outs.view(W, T, H, D)[:, :, sl], lses.view(W, T, H)[:, :, sl], out.dtype,
                       res, res_lse)


@MERGE_REGISTRY.register
class AgRsBackend(DcpBackend):
    """all_gather the LSEs (small), scale this rank's output by its weight locally, then
    reduce_scatter over head slices with fp32 accumulation (SGLang/vLLM's DCP "correct + RS")."""

    name = "ag_rs"

    def __call__(self, out, lse, res=None, res_lse=None):
        W, r = self.world_size, self.rank
        T, H, D = out.shape
        hs = H // W
        lses = torch.empty((W * T, H), dtype=torch.float32, device=out.device)
        work = all_gather_tensor(lses, lse, self.group, async_op=True)
        wait(work, self.group, "dcp.merge[ag_rs] all_gather LSE", self.timeout_s)
        dest = torch.empty((W, T, hs, D), dtype=torch.float32, device=out.device)
        lse_all = scale_own(out, lses.view(W, T, H), r, dest)
        merged = torch.empty((T, hs, D), dtype=torch.float32, device=out.device)
        work = reduce_scatter_tensor(merged, dest.view(W * T, hs, D), self.group, async_op=True)
        wait(work, self.group, "dcp.merge[ag_rs] reduce_scatter", self.timeout_s)
        mine = lse_all[:, r * hs:(r + 1) * hs]
        return (merged.to(out.dtype) if res is None else res.copy_(merged),  # one rounding
                mine if res_lse is None else res_lse.copy_(mine))


@MERGE_REGISTRY.register
class A2ABackend(DcpBackend):
    """Pack output and LSE by destination head slice into one buffer (the fp32 LSE bit-packed as
    1–2 extra elements after each row's D values), one all_to_all_single, combine locally."""

    name = "a2a"

    def __call__(self, out, lse, res=None, res_lse=None):
        W = self.world_size
        T, H, D = out.shape
        hs = H // W
        k = 4 // out.element_size()  # elements of out.dtype holding one fp32 LSE
        send = torch.empty((W, T, hs, D + k), dtype=out.dtype, device=out.device)
        send[..., :D].copy_(out.view(T, W, hs, D).permute(1, 0, 2, 3))
        send[..., D:].copy_(lse.reshape(T, W, hs, 1).contiguous().view(out.dtype)
                            .permute(1, 0, 2, 3))
        recv = torch.empty_like(send)
        work = all_to_all_single(as_bits(recv), as_bits(send), group=self.group, async_op=True)
        wait(work, self.group, "dcp.merge[a2a] all_to_all", self.timeout_s)
        lses = recv[..., D:].contiguous().view(torch.float32).squeeze(-1)
        return combine(recv[..., :D], lses, out.dtype, res, res_lse)

