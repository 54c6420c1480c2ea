"""``DcpAttention``: one DCP decode attention layer — query gather, local attention, LSE merge.

Each rank holds the query heads of its slice (its share of a head-sharded q projection) and a
shard of the KV cache along the sequence. Per decode step:

1. ``DcpQueryGather``: every rank's ``[T, H/W, D]`` slice (rotated on its last ``rope_dim``
   dims) → ``q_all [T, H, D]`` on every rank;
2. ``attn_fn(q_all, *args, **kwargs) -> (out [T, H, Dv], lse [T, H])``: the caller's attention
   of all heads over this rank's KV shard (an MLA or GQA decode kernel), LSE base ``lse_base``;
3. ``DcpMerger``: merge the partial outputs by LSE → this rank's head slice ``[T, H/W, Dv]`` for
   the head-sharded o_proj.

The gathered query is a view of the gather's persistent buffer. The merge is a cross-rank
dependency on every rank's attention (a peer's merge of step e completes only once this rank's
attention of step e, the reader of ``q_all``, has produced its output), so a peer's gather of
step e+1 can never overwrite a ``q_all`` this rank still reads: the gather is built with
``ordered_by_caller=True`` and skips its own handshake.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .._dist import Lifecycle, resolve_group
from .lse_merge import DcpMerger
from .query_gather import DcpQueryGather

__all__ = ["DcpAttention"]


class DcpAttention(Lifecycle, torch.nn.Module):
    """Gather → the caller's attention over the local KV shard → merge (see the module doc).

    Arguments:
        attn_fn: ``attn_fn(q_all [T, H, D], *args, **kwargs) -> (out [T, H, Dv], lse [T, H])``,
            run on the current stream; ``out`` in ``out_dtype``, ``lse`` any float dtype in base
            ``lse_base`` (−inf for a query with no key in this shard).
        group: the DCP process group of W ranks (None: default). Construction is collective.
        max_tokens: largest T per call. num_heads: H (divisible by W). head_dim: D of q.
        dtype: fp16/bf16/fp32 of q. v_head_dim: Dv (None: D). out_dtype: of ``out`` (None:
            ``dtype``).
        rope_dim: R of ``DcpQueryGather`` (0: no rotation). lse_base: "e" or "2".
        gather_backend, merge_backend: "auto" or a named backend of each exchange.
        timeout_s: wait budget (None → ``ATTNCOMM_TIMEOUT_S``).
        device: where both exchanges' buffers live (None: the group's device, as
            ``DcpMerger``'s).

    ``forward(q [T, H/W, D], *args, rope=None, **kwargs)`` → ``[T, H/W, Dv]`` in ``out_dtype``
    (a view valid until the next call when the merge backend returns views), heads
    ``[r·H/W, (r+1)·H/W)`` of attention over the whole (sharded) KV cache. CUDA-graph
    capturable when ``attn_fn`` is; under ``torch.compile`` the gather and the merge are their
    objects' custom ops and ``attn_fn`` is traced between them. ``close()`` (or the end of a
    ``with`` block) frees both exchanges' buffers, collectively.

    Raises:
        ValueError: bad arguments (every rank), or ``attn_fn`` returning wrong shapes.
        PeerTimeoutError: a peer did not answer within ``timeout_s``.
    """

    def __init__(self, attn_fn: Callable, group=None, *, max_tokens: int, num_heads: int,
                 head_dim: int, dtype: torch.dtype, v_head_dim: int | None = None,
                 out_dtype: torch.dtype | None = None, rope_dim: int = 0, lse_base: str = "e",
                 gather_backend: str = "auto", merge_backend: str = "auto",
                 timeout_s: float | None = None, device=None):
        super().__init__()
        self.attn_fn = attn_fn
        self.group = group = resolve_group(group, "DcpAttention")
        self.world_size = dist.get_world_size(group)
        self.num_heads = num_heads
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.out_dtype = dtype if out_dtype is None else out_dtype
        self.gather = DcpQueryGather(group, max_tokens=max_tokens, num_heads=num_heads,
                                     head_dim=head_dim, dtype=dtype, backend=gather_backend,
                                     rope_dim=rope_dim, timeout_s=timeout_s,
                                     ordered_by_caller=True, device=device)
        self.merger = DcpMerger(group, max_tokens=max_tokens, num_heads=num_heads,
                                head_dim=self.v_head_dim, dtype=self.out_dtype,
                                backend=merge_backend, lse_base=lse_base, timeout_s=timeout_s,
                                device=device)

    @property
    def backends(self) -> tuple[str, str]:
        """(gather backend, merge backend) in use."""
        return self.gather.backend, self.merger.backend

    def check(self) -> None:
        """Raise ``PeerTimeoutError`` for any timeout recorded on the device (both exchanges)."""
        self.gather.check()
        self.merger.check()

    def _release(self) -> None:
        self.gather.close()
        self.merger.close()

    def forward(self, q: torch.Tensor, *args, rope=None, **kwargs) -> torch.Tensor:
        self._ensure_open()
        q_all = self.gather(q, rope=rope)
        T, H = q_all.shape[0], self.num_heads
        out, lse = self.attn_fn(q_all, *args, **kwargs)
        if not isinstance(out, torch.Tensor) or not isinstance(lse, torch.Tensor) \
                or tuple(out.shape) != (T, H, self.v_head_dim) or tuple(lse.shape) != (T, H):
            raise ValueError(f"DcpAttention: attn_fn must return out [T={T}, H={H}, "
                             f"Dv={self.v_head_dim}] and lse [T, H]; got "
                             f"{getattr(out, 'shape', out)}, {getattr(lse, 'shape', lse)}")
        return self.merger(out, lse)
