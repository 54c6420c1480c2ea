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

A key-padding mask (bool ``[B, S_r]``, this rank's keys) travels around the ring with its K/V
block (as one more tensor of the same transfer) and reaches ``attn_fn`` with the block's keys.
Packed sequences (``cu_seqlens``) turn each step into the segments of ``ring_segments``; their
per-step list is a plan kept per (layout, causal, W, rank, S_r, boundaries), made on the first
call with those boundaries (outside CUDA graph capture: the warm-up rule).

Under ``torch.compile`` a call is one custom op, ``attncomm::ring_attention``, that runs the
eager call when the graph runs (Dynamo cannot trace the ring's point-to-point transfers, and
the boundaries are read on the host): the mask and ``cu_seqlens`` are tensors of the op, so one
graph serves every mask and every set of boundaries of a shape. The group travels by name; a
``RingAttention``'s ``attn_fn`` by the module's registered name (``_plans.register``).

Schedule of one rank (W = 4; ``post(i)`` sends block i on and receives block i+1)::

    post(0) attend(0) merge(0) wait(0) | post(1) attend(1) merge(1) wait(1) | ... attend(3) merge(3)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import functools
import zlib

from .. import _agree, _dist, config
from .._plans import (lookup, register, timeout_arg, timeout_code, validate_arg, validate_code,
                      warm_up_error)
from ..errors import PeerTimeoutError
from .attn import attention_with_lse
from .comm import RingComm
from .layout import (LAYOUTS, cu_seqlens_error, cu_values, layout_error, ring_block,
                     ring_segments)
from .merge import merge_block, new_state

__all__ = ["ring_attention", "RingAttention", "DTYPES", "local_error", "signature", "LAYOUT_CODES"]

#: Input dtypes the ring takes (the state is fp32 whatever the input).
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: ``layout`` as the int an argument check agrees on.
LAYOUT_CODES = {name: i + 1 for i, name in enumerate(LAYOUTS)}
LABELS = ["B", "S_r", "Hq", "D", "Hkv", "Dv", "q dtype", "k dtype", "v dtype", "CUDA", "layout",
          "causal", "return_lse", "key_padding_mask given", "cu_seqlens (N + 1, -1: none)",
          "cu_seqlens (CRC-32)"]


def _describe(q, k, v) -> str:
    return ", ".join(f"{n} {list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                     for n, t in zip("qkv", (q, k, v)))


def key_mask_error(mask, b: int, s: int, device, name: str = "key_padding_mask",
                   rows: str = "S_r") -> str | None:
    """Why ``mask`` (the argument ``name``) is not a key-padding mask of ``[B, rows] = [b, s]``
    on ``device`` (bool, True = attend), or None; None is no mask."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool \
            or tuple(mask.shape) != (b, s) or mask.device != device:
        got = (f"{list(mask.shape)} {mask.dtype} on {mask.device}"
               if isinstance(mask, torch.Tensor) else type(mask).__name__)
        return (f"{name} must be a bool tensor [B, {rows}] = [{b}, {s}] on {device} "
                f"(True = attend), got {got}")
    return None


def read_cu(cu_seqlens) -> tuple[tuple | None, str | None]:
    """``(boundaries, error)``: ``cu_seqlens`` (an int32 1-D tensor, read on the host) as a
    tuple of ints and None, ``(None, None)`` without one, or ``(None, why)`` for a bad one.
    Raises the warm-up ``ValueError`` for a GPU tensor inside CUDA graph capture."""
    if cu_seqlens is None:
        return None, None
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 \
            or cu_seqlens.dim() != 1:
        got = (f"{list(cu_seqlens.shape)} {cu_seqlens.dtype}"
               if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__)
        return None, f"cu_seqlens must be a 1-D int32 tensor [N + 1], got {got}"
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        raise warm_up_error("ring_attention", "cu_seqlens on the GPU (its values plan the "
                            "steps; pass a CPU tensor to capture)")
    return cu_values(cu_seqlens), None


def cu_signature(cu: tuple | None, given: bool = False) -> list[int]:
    """``[N + 1, CRC-32 of the boundaries]``: ``[-1, -1]`` without, ``[-2, -1]`` for boundaries
    given but unreadable (``read_cu``'s error)."""
    if cu is None:
        return [-2 if given else -1, -1]
    return [len(cu), zlib.crc32(torch.tensor(cu, dtype=torch.int64).numpy().tobytes())]


def local_error(q, k, v, layout, key_padding_mask=None, cu=None, world: int = 1) -> str | None:
    """This rank's argument errors (no communication), or None. ``cu``: the boundaries as a
    tuple (``read_cu``), over ``world`` ranks."""
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
    why = layout_error(layout, s_r) or key_mask_error(key_padding_mask, b, s_r, q.device)
    if why is None and cu is not None and layout in LAYOUTS:
        why = cu_seqlens_error(cu, world * s_r, world, layout)
    return why


def signature(q, k, v, layout, causal, return_lse, key_padding_mask=None,
              cu: tuple | None = None, cu_given: bool = False) -> list[int]:
    """The ints every rank must agree on (``LABELS`` names them); −1 where a tensor is not a
    4-D tensor (its local error already says why)."""
    ok = all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v))
    dims = [*q.shape, k.shape[2], v.shape[3]] if ok else [-1] * 6
    codes = [_agree.DTYPE_CODES.get(t.dtype, 0) if isinstance(t, torch.Tensor) else 0
             for t in (q, k, v)]
    return [*dims, *codes, int(bool(ok and q.is_cuda)), LAYOUT_CODES.get(layout, 0),
            int(bool(causal)), int(bool(return_lse)), int(key_padding_mask is not None),
            *cu_signature(cu, cu_given)]


@functools.lru_cache(maxsize=256)
def segment_plan(layout: str, causal: bool, world: int, rank: int, s_r: int,
                 cu: tuple) -> tuple:
    """The segments of every ring step for the boundaries ``cu``: made once per key (an LRU of
    256), outside CUDA graph capture (the warm-up error inside one; an error is not kept)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise warm_up_error("ring_attention", f"cu_seqlens {list(cu)[:8]}")
    return tuple(ring_segments(layout, causal, world, rank, i, s_r, cu) for i in range(world))


def _call_block(attn_fn, q, k, v, causal, mask, segments):
    """``attn_fn`` with the keywords of what this call carries (none for a dense call)."""
    kw = {}
    if mask is not None:
        kw["key_padding_mask"] = mask
    if segments is not None:
        kw["segments"] = segments
    return attn_fn(q, k, v, causal, **kw)


def _run(q, k, v, group, causal: bool, layout: str, attn_fn, timeout_s: float, op: str,
         key_padding_mask=None, cu: tuple | None = None):
    """The ring forward on checked inputs: ``(out [B, S_r, Hq, Dv] in q's dtype, lse
    [B, S_r, Hq] fp32)``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    b, s_r, hq, _ = q.shape
    dv = v.shape[3]
    acc, acc_lse = new_state(b, s_r, hq, dv, q.device)
    if acc.numel() == 0:
        return acc.to(q.dtype), acc_lse
    comm = RingComm(group, timeout_s, op) if world > 1 else None
    # The mask travels as bytes (a bool tensor's storage, viewed) with its K/V block.
    cur = [k.contiguous(), v.contiguous()]
    if key_padding_mask is not None:
        cur.append(key_padding_mask.contiguous().view(torch.uint8))
    plan = None if cu is None else segment_plan(layout, causal, world, rank, s_r, cu)
    bufs: list = []
    for step in range(world):
        pending = None
        if step + 1 < world:  # post the next block's transfer before this block's attention
            if not bufs:
                bufs = [[torch.empty_like(t) for t in cur] for _ in range(2)]
            nxt = bufs[step % 2]
            pending = comm.start(cur, nxt)
        k_cur, v_cur = cur[0], cur[1]
        mask = cur[2].view(torch.bool) if len(cur) > 2 else None
        if plan is None:
            blk = ring_block(layout, causal, world, rank, step, s_r)
            segs = None
        else:  # packed sequences: the whole blocks, with this step's segments
            segs = plan[step]
            blk = ring_block(layout, False, world, rank, step, s_r) if segs else None
        if blk is not None:
            try:
                out, lse = _call_block(attn_fn, q[:, blk.q_lo:blk.q_hi],
                                       k_cur[:, blk.k_lo:blk.k_hi], v_cur[:, blk.k_lo:blk.k_hi],
                                       blk.causal, None if mask is None
                                       else mask[:, blk.k_lo:blk.k_hi], segs)
                _require_attn_result(out, lse, (b, blk.q_hi - blk.q_lo, hq, dv), op)
            except BaseException:
                # Finish the posted transfer first: a receive left pending would take the
                # next call's block.
                if pending is not None:
                    _drain(comm, pending, step)
                raise
            merge_block(acc[:, blk.q_lo:blk.q_hi], acc_lse[:, blk.q_lo:blk.q_hi], out, lse)
        if pending is not None:
            comm.wait(pending, step)
            cur = nxt
    return acc.to(q.dtype), acc_lse


def _drain(comm: RingComm, pending: list, step: int) -> None:
    try:
        comm.wait(pending, step)
    except PeerTimeoutError:  # the error being raised says more
        pass


def _require_attn_result(out, lse, want, op: str) -> None:
    if not (isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
            and tuple(out.shape) == want and tuple(lse.shape) == want[:3]):
        got = [list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
               for x in (out, lse)]
        raise ValueError(f"{op}: attn_fn must return (out {list(want)}, lse {list(want[:3])}), "
                         f"got {got}")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                   causal: bool = False, layout: str = "contiguous", return_lse: bool = False,
                   attn_fn=None, validate: bool | None = None, timeout_s: float | None = None,
                   key_padding_mask: torch.Tensor | None = None,
                   cu_seqlens: torch.Tensor | None = None):
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
            (``causal`` only for square blocks); a non-finite LSE marks an empty row. With a
            mask it is also given ``key_padding_mask=`` (bool ``[B, Sk]``, the block's keys);
            with ``cu_seqlens``, ``segments=`` (the block's ``Segment`` tuples ``(q_lo, q_hi,
            k_lo, k_hi, causal)`` in its own row coordinates: query rows attend only their
            segment's keys, rows of no segment are empty) and ``causal=False``. Default:
            ``attention_with_lse`` (fp32 math on CPU, SDPA's kernel with its LSE on CUDA).
        validate: cross-rank argument check, one small gloo collective (None: env
            ``ATTNCOMM_VALIDATE``; unset, on the first call with a new signature per group;
            True every call; False never), as every functional call's.
        timeout_s: bound of every wait in seconds (None: ``ATTNCOMM_TIMEOUT_S``, 60).
        key_padding_mask: bool ``[B, S_r]`` of this rank's keys (True = attend), sharded like
            k (None: every key). A fully masked block is an empty source of the merge.
        cu_seqlens: int32 ``[N + 1]``, the boundaries of N packed sequences over the global
            token order (0 … ``W·S_r``), the same on every rank (None: one sequence).
            Attention never crosses a boundary and is causal within each sequence; a step with
            no pair of one sequence is skipped. ``"zigzag"`` then zigzags every sequence on its
            own (``zigzag_shard(..., cu_seqlens=)``; each length divisible by 2W). Read on the
            host: a CPU tensor costs no sync, and only a CPU tensor may be passed under CUDA
            graph capture (its boundaries planned by an eager call first).

    Under ``torch.compile(fullgraph=True)`` the call with the default ``attn_fn`` is the custom
    op ``attncomm::ring_attention`` (the eager call, run when the graph runs: checks, transfers,
    new boundaries' plans), the mask and ``cu_seqlens`` tensors of the op. A custom ``attn_fn``
    cannot be an argument of an op: it is traced as Python, and Dynamo cannot trace the ring's
    transfers at W ≥ 2 (``RingAttention(attn_fn)`` compiles as one op instead).

    Returns:
        ``[B, S_r, Hq, Dv]`` in q's dtype: this rank's rows of the attention over all ``W·S_r``
        positions (and ``[B, S_r, Hq]`` fp32 LSE, base e, with ``return_lse``). Accumulated in
        fp32, rounded once. A row with no key in any block (masked, or outside its sequence)
        is 0 with LSE −inf.

    Raises:
        ValueError (every rank alike unless validation is off): not 4-D tensors, shapes,
            ``Hq % Hkv``, dtypes, devices, an unknown layout, zigzag with an odd ``S_r``, a
            mask not bool ``[B, S_r]`` on q's device, bad ``cu_seqlens``, ranks that disagree
            on any of them (``S_r``, a mask given, the boundaries included).
        PeerTimeoutError: a ring neighbour did not answer within ``timeout_s`` (named).
    """
    if attn_fn is None and torch.compiler.is_compiling():
        out, lse = _traced(q, k, v, group, causal, layout, return_lse, "", validate, timeout_s,
                           key_padding_mask, cu_seqlens)
    else:
        out, lse = _call(q, k, v, group, causal, layout, return_lse, attn_fn, validate,
                         timeout_s, key_padding_mask, cu_seqlens)
    return (out, lse) if return_lse else out


def _call(q, k, v, group, causal, layout, return_lse, attn_fn, validate, timeout_s,
          key_padding_mask, cu_seqlens):
    """The eager call: the checks (across ranks on a new signature), then the ring: ``(out,
    lse)`` whatever ``return_lse`` (it is part of the checked signature)."""
    budget = config.timeout_s(timeout_s)
    cu, error = read_cu(cu_seqlens)
    world = dist.get_world_size(group)
    error = error or local_error(q, k, v, layout, key_padding_mask, cu, world)
    sig = signature(q, k, v, layout, causal, return_lse, key_padding_mask, cu,
                    cu_seqlens is not None)
    _agree.validate_args(group, "ring_attention", sig, LABELS, error, budget, validate)
    return _run(q, k, v, group, bool(causal), layout, attn_fn or attention_with_lse, budget,
                "ring_attention", key_padding_mask, cu)


class RingAttention(torch.nn.Module):
    """The module form of ``ring_attention`` (same arguments; ``forward(q, k, v, *,
    causal=False, return_lse=False, key_padding_mask=None, cu_seqlens=None)``).

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

    torch.compile: under ``torch.compile(fullgraph=True)`` a forward is the custom op
    ``attncomm::ring_attention``, which runs the eager call when the graph runs (checks, the
    ring's transfers, ``attn_fn`` uncompiled); the mask and ``cu_seqlens`` are tensors of the op,
    so one graph serves every mask and every set of boundaries of a shape (new boundaries plan
    when the graph runs: read on the host, a CPU tensor; inside CUDA graph capture the plan must
    exist, the warm-up error otherwise).
    """

    def __init__(self, attn_fn=None, group=None, *, layout: str = "contiguous",
                 timeout_s: float | None = None, validate: bool | None = None):
        super().__init__()
        self.attn_fn, self.group, self.layout = attn_fn, group, layout
        self.timeout_s, self.validate = timeout_s, validate
        self._closed = False
        self._op_name = register(self)  # the compiled op finds attn_fn by this
        _agree.validate_args(group, "RingAttention", [LAYOUT_CODES.get(layout, 0)], ["layout"],
                            layout_error(layout), config.timeout_s(timeout_s),
                            config.validation_mode(validate) != "never")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                causal: bool = False, return_lse: bool = False,
                key_padding_mask: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None):
        if torch.compiler.is_compiling():  # the op checks that the module is open, when it runs
            out, lse = _traced(q, k, v, self.group, causal, self.layout, return_lse,
                               self._op_name, self.validate, self.timeout_s, key_padding_mask,
                               cu_seqlens)
            return (out, lse) if return_lse else out
        self._check_open()
        return ring_attention(q, k, v, self.group, causal=causal, layout=self.layout,
                              return_lse=return_lse, attn_fn=self.attn_fn,
                              validate=self.validate, timeout_s=self.timeout_s,
                              key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("RingAttention: this object is closed (close() was called)")

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._op_name = register(self)  # a copy is found by a name of its own

    def close(self) -> None:
        """End this object's use (it holds no peer memory; later calls raise)."""
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------ torch.compile
def _traced(q, k, v, group, causal, layout, return_lse, owner, validate, timeout_s,
            key_padding_mask, cu_seqlens):
    """The traced call: one ``attncomm::ring_attention`` op, ``(out, lse)``."""
    return torch.ops.attncomm.ring_attention(
        q, k, v, _dist.group_name(group), bool(causal), layout, bool(return_lse), owner,
        validate_code(validate), timeout_code(timeout_s), key_padding_mask, cu_seqlens)


@torch.library.custom_op("attncomm::ring_attention", mutates_args=())
def _ring_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str,
                       causal: bool, layout: str, return_lse: bool, owner: str, validate: int,
                       timeout_s: float, key_padding_mask: torch.Tensor | None = None,
                       cu_seqlens: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager ``ring_attention`` over the group named ``group_name`` with ``attn_fn`` of the
    ``RingAttention`` named ``owner`` (``""``: the default), ``validate`` and ``timeout_s`` as
    ``_plans.validate_code`` / ``timeout_code``: ``(out, lse)`` (both always; the checked
    signature holds ``return_lse``)."""
    attn_fn = None
    if owner:
        mod = lookup(owner)
        mod._check_open()
        attn_fn = mod.attn_fn
    return _call(q, k, v, _dist.group_from_name(group_name), causal, layout, return_lse,
                 attn_fn, validate_arg(validate), timeout_arg(timeout_s), key_padding_mask,
                 cu_seqlens)


@_ring_attention_op.register_fake
def _(q, k, v, group_name, causal, layout, return_lse, owner, validate, timeout_s,
      key_padding_mask=None, cu_seqlens=None):
    err = local_error(q, k, v, layout, key_padding_mask)  # while tracing, as the eager call
    if err:
        raise ValueError(f"ring_attention: invalid arguments — {err}")
    b, s_r, hq = q.shape[:3]
    return (q.new_empty((b, s_r, hq, v.shape[3])),
            q.new_empty((b, s_r, hq), dtype=torch.float32))
