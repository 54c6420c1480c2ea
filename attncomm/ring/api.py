"""``ring_attention`` and ``RingAttention``: attention over a sequence sharded across the ranks
of a group, K/V blocks passed around the ring.

Ring attention (Liu, Zaharia, Abbeel, "Ring Attention with Blockwise Transformers", 2023,
arXiv:2310.01889; the forward of ring-flash-attention's ``ring_flash_attn`` and
``zigzag_ring_flash_attn``). Each of the W ranks holds ``S_r`` rows of q, k and v. In W steps every
rank attends its queries to every rank's K/V block: at step i it holds the block of rank
``(r − i) mod W``, and while it attends that block the block moves on to rank r+1 and the next one
arrives from rank r−1 (``ring/comm.py``). The partial outputs are merged online by their LSE
(``ring/merge.py``: the DCP merge's math and special-value rule). Which rows a step attends, and
which steps a causal mask skips, is ``ring/layout.py``'s table.

Schedule of one rank (W = 4; ``post(i)`` sends block i on and receives block i+1)::

    post(0) attend(0) merge(0) wait(0) | post(1) attend(1) merge(1) wait(1) | ... attend(3) merge(3)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _agree, config
from ..errors import PeerTimeoutError
from .attn import attention_with_lse
from .comm import RingComm
from .layout import LAYOUTS, layout_error, ring_block
from .merge import merge_block, new_state

__all__ = ["ring_attention", "RingAttention", "DTYPES", "local_error", "signature", "LAYOUT_CODES"]

#: Input dtypes the ring takes (the state is fp32 whatever the input).
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: ``layout`` as the int an argument check agrees on.
LAYOUT_CODES = {name: i + 1 for i, name in enumerate(LAYOUTS)}
LABELS = ["B", "S_r", "Hq", "D", "Hkv", "Dv", "q dtype", "k dtype", "v dtype", "CUDA", "layout",
          "causal", "return_lse"]


def _describe(q, k, v) -> str:
    return ", ".join(f"{n} {list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                     for n, t in zip("qkv", (q, k, v)))


def local_error(q, k, v, layout) -> str | None:
    """This rank's argument errors (no communication), or None."""
    tens = [t for t in (q, k, v) if isinstance(t, torch.Tensor)]
    if len(tens) != 3 or any(t.dim() != 4 for t in tens):
        return f"q, k, v must be 4-D tensors [B, S_r, H, D], got {_describe(q, k, v)}"
    b, s_r, hq, d = q.shape
    if tuple(k.shape[:2]) != (b, s_r) or tuple(v.shape[:3]) != tuple(k.shape[:3]):
        return (f"shapes disagree: {_describe(q, k, v)} (need the same B and S_r; k and v the "
                f"same Hkv)")
    hkv = k.shape[2]
    if hq < 1 or hkv < 1:
        return f"need at least one head: Hq = {hq}, Hkv = {hkv}"
    if hq % hkv:
        return f"Hq % Hkv != 0: Hq = {hq}, Hkv = {hkv}"
    if k.shape[3] != d:
        return f"q has D = {d} but k has D = {k.shape[3]}"
    if any(t.dtype not in DTYPES for t in tens) or len({t.dtype for t in tens}) != 1:
        return (f"q, k, v must share one dtype among fp16/bf16/fp32, got "
                f"{[str(t.dtype) for t in tens]}")
    if len({t.device for t in tens}) != 1:
        return f"q, k, v are on different devices: {[str(t.device) for t in tens]}"
    return layout_error(layout, s_r)


def signature(q, k, v, layout, causal, return_lse) -> list[int]:
    """The ints every rank must agree on (``LABELS`` names them); −1 where a tensor is not a
    4-D tensor (its local error already says why)."""
    ok = all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v))
    dims = [*q.shape, k.shape[2], v.shape[3]] if ok else [-1] * 6
    codes = [_agree.DTYPE_CODES.get(t.dtype, 0) if isinstance(t, torch.Tensor) else 0
             for t in (q, k, v)]
    return [*dims, *codes, int(bool(ok and q.is_cuda)), LAYOUT_CODES.get(layout, 0),
            int(bool(causal)), int(bool(return_lse))]


def _run(q, k, v, group, causal: bool, layout: str, attn_fn, timeout_s: float, op: str):
    """The ring forward on checked inputs: ``(out [B, S_r, Hq, Dv] in q's dtype, lse
    [B, S_r, Hq] fp32)``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    b, s_r, hq, _ = q.shape
    dv = v.shape[3]
    acc, acc_lse = new_state(b, s_r, hq, dv, q.device)
    if acc.numel() == 0:
        return acc.to(q.dtype), acc_lse
    comm = RingComm(group, timeout_s, op) if world > 1 else None
    k_cur, v_cur = k.contiguous(), v.contiguous()
    bufs: list = []
    for step in range(world):
        pending = None
        if step + 1 < world:  # post the next block's transfer before this block's attention
            if not bufs:
                bufs = [(torch.empty_like(k_cur), torch.empty_like(v_cur)) for _ in range(2)]
            nxt = bufs[step % 2]
            pending = comm.start([k_cur, v_cur], list(nxt))
        blk = ring_block(layout, causal, world, rank, step, s_r)
        if blk is not None:
            try:
                out, lse = attn_fn(q[:, blk.q_lo:blk.q_hi], k_cur[:, blk.k_lo:blk.k_hi],
                                   v_cur[:, blk.k_lo:blk.k_hi], blk.causal)
                _check_result(out, lse, (b, blk.q_hi - blk.q_lo, hq, dv), op)
            except BaseException:
                # Finish the posted transfer first: a receive left pending would take the
                # next call's block.
                if pending is not None:
                    _drain(comm, pending, step)
                raise
            merge_block(acc[:, blk.q_lo:blk.q_hi], acc_lse[:, blk.q_lo:blk.q_hi], out, lse)
        if pending is not None:
            comm.wait(pending, step)
            k_cur, v_cur = nxt
    return acc.to(q.dtype), acc_lse


def _drain(comm: RingComm, pending: list, step: int) -> None:
    try:
        comm.wait(pending, step)
    except PeerTimeoutError:  # the error being raised says more
        pass


def _check_result(out, lse, want, op: str) -> None:
    if not (isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
            and tuple(out.shape) == want and tuple(lse.shape) == want[:3]):
        got = [list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
               for x in (out, lse)]
        raise ValueError(f"{op}: attn_fn must return (out {list(want)}, lse {list(want[:3])}), "
                         f"got {got}")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                   causal: bool = False, layout: str = "contiguous", return_lse: bool = False,
                   attn_fn=None, validate: bool | None = None, timeout_s: float | None = None):
    """Attention over the whole sequence, sharded over the ranks of ``group`` (ring attention).

    Arguments:
        q: ``[B, S_r, Hq, D]``, this rank's query rows (fp16/bf16/fp32).
        k: ``[B, S_r, Hkv, D]``, v: ``[B, S_r, Hkv, Dv]``, this rank's key/value rows, the
            dtype of q; ``Hq % Hkv == 0`` (query head h uses KV head ``h // (Hq / Hkv)``). K/V
            travel with their ``Hkv`` heads; only ``attn_fn`` expands them.
        group: process group of W ranks, the ring in rank order (None: the default group).
        causal: causal attention over global positions.
        layout: which positions this rank's rows are (the same ``S_r`` on every rank):
            ``"contiguous"``: rank r holds ``[r·S_r, (r+1)·S_r)``; ``"zigzag"``: the sequence in
            2W chunks of ``S_r/2``, rank r holds chunks r and 2W−1−r in that order
            (``zigzag_shard``); under causal attention fully masked blocks are skipped.
        return_lse: also return the LSE.
        attn_fn: ``attn_fn(q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv], causal) ->
            (out [B, Sq, Hq, Dv] (fp16/bf16/fp32), lse [B, Sq, Hq] fp32 base e)`` for one block
            (``causal`` only for square blocks); a non-finite LSE marks an empty row. Default:
            ``attention_with_lse`` (fp32 math on CPU, SDPA's kernel with its LSE on CUDA).
        validate: cross-rank argument check, one small gloo collective (None: env
            ``ATTNCOMM_VALIDATE``; unset, on the first call with a new signature per group;
            True every call; False never), as every functional call's.
        timeout_s: bound of every wait in seconds (None: ``ATTNCOMM_TIMEOUT_S``, 60).

    Returns:
        ``[B, S_r, Hq, Dv]`` in q's dtype: this rank's rows of the attention over all ``W·S_r``
        positions (and ``[B, S_r, Hq]`` fp32 LSE, base e, with ``return_lse``). Accumulated in
        fp32, rounded once. A row with no key in any block is 0 with LSE −inf.

    Raises:
        ValueError (every rank alike unless validation is off): not 4-D tensors, shapes,
            ``Hq % Hkv``, dtypes, devices, an unknown layout, zigzag with an odd ``S_r``, ranks
            that disagree on any of them (``S_r`` included).
        PeerTimeoutError: a ring neighbour did not answer within ``timeout_s`` (named).
    """
    budget = config.timeout_s(timeout_s)
    error = local_error(q, k, v, layout)
    _agree.validate_args(group, "ring_attention", signature(q, k, v, layout, causal, return_lse),
                        LABELS, error, budget, validate)
    out, lse = _run(q, k, v, group, bool(causal), layout, attn_fn or attention_with_lse, budget,
                    "ring_attention")
    return (out, lse) if return_lse else out


class RingAttention(torch.nn.Module):
    """The module form of ``ring_attention`` (same arguments; ``forward(q, k, v, *,
    causal=False, return_lse=False)``).

    Arguments:
        attn_fn: the per-block attention (see ``ring_attention``; None: the default).
        group: the ring's process group (None: the default group).
        layout: ``"contiguous"`` or ``"zigzag"``.
        timeout_s: wait bound (None: ``ATTNCOMM_TIMEOUT_S``).
        validate: cross-rank argument check of each call, as ``ring_attention``'s; the
            construction's check runs unless it is False (or env ``ATTNCOMM_VALIDATE=0``).

    The construction is collective: every rank of ``group`` checks that all ranks chose the same
    layout (``ValueError`` on every rank otherwise). The object holds no buffers between calls;
    ``close()`` (or leaving a ``with`` block) ends its use.
    """

    def __init__(self, attn_fn=None, group=None, *, layout: str = "contiguous",
                 timeout_s: float | None = None, validate: bool | None = None):
        super().__init__()
        self.attn_fn, self.group, self.layout = attn_fn, group, layout
        self.timeout_s, self.validate = timeout_s, validate
        self._closed = False
        _agree.validate_args(group, "RingAttention", [LAYOUT_CODES.get(layout, 0)], ["layout"],
                            layout_error(layout), config.timeout_s(timeout_s),
                            config.validation_mode(validate) != "never")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                causal: bool = False, return_lse: bool = False):
        if self._closed:
            raise RuntimeError("RingAttention: this object is closed (close() was called)")
        return ring_attention(q, k, v, self.group, causal=causal, layout=self.layout,
                              return_lse=return_lse, attn_fn=self.attn_fn,
                              validate=self.validate, timeout_s=self.timeout_s)

    def close(self) -> None:
        """End this object's use (it holds no peer memory; later calls raise)."""
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
