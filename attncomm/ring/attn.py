"""The ring's default ``attn_fn``: attention of one block that also returns its log-sum-exp.

``attn_fn(q, k, v, causal) -> (out, lse)`` is the contract (docs/API.md, ring attention):
``q [B, Sq, Hq, D]``, ``k [B, Sk, Hkv, D]``, ``v [B, Sk, Hkv, Dv]`` with ``Hq % Hkv == 0``
(query head h uses KV head ``h // (Hq / Hkv)``; the KV heads are expanded here, never on the
wire) → ``out [B, Sq, Hq, Dv]`` (q's dtype, or fp32) and ``lse [B, Sq, Hq]`` fp32, base e,
scale ``1/√D``. ``causal`` is only asked for square blocks (``Sq == Sk``): query i sees keys ≤ i.

- CPU (and any case the fused kernels do not take): ``reference_attention``, fp32 math; its
  output stays fp32 (the ring merges in fp32, so a block's output is rounded only once, at the
  end).
- CUDA: the kernel PyTorch's SDPA itself would pick for these tensors
  (``torch._fused_sdp_choice``), called through its ATen op with the log-sum-exp requested:
  ``_scaled_dot_product_flash_attention`` (FlashAttention-2, returns ``logsumexp`` always),
  ``_scaled_dot_product_efficient_attention`` (``compute_log_sumexp=True``; its LSE is padded to
  a multiple of 32 rows) or ``_scaled_dot_product_cudnn_attention`` (``compute_log_sumexp=True``).
  So the ring's attention costs what ``scaled_dot_product_attention`` costs on the same shapes
  (measured: benchmarks/results/ring-one-gpu-*.md). A kernel that raises for a shape is not
  asked again for that (kernel, dtype, D, Dv) in this process; the next one in the order flash →
  efficient → math is used, and ``last_kernel()`` says which ran.
- CUDA with a key-padding mask, non-causal: the block as a variable-length batch
  (``masked_varlen``): each batch row's attended keys gathered to the front by a stable sort of
  the mask (``compact_keys``, no host sync), then FlashAttention-2's varlen kernel with the
  cumulative counts as the key boundaries (GQA in the kernel), so the masked keys cost nothing.
  Causal with a mask: cuDNN's kernel (else the efficient one) with the mask as a −inf bias
  (sorting the keys would lose the positions causality compares; in the ring only the diagonal
  step is causal).
- CUDA with segments (packed sequences): FlashAttention-2's varlen kernel over the segments
  (``_varlen``); one segment over the whole block is the dense call.
"""
from __future__ import annotations

import functools
import math

import torch

__all__ = ["attention_with_lse", "reference_attention", "last_kernel", "KERNELS",
           "masked_varlen", "masked_attention", "compact_keys", "pack_masked"]

#: Names ``last_kernel()`` reports.
KERNELS = ("math", "flash", "efficient", "cudnn", "flash-varlen")
_FUSED_ORDER = ("flash", "efficient")
_BROKEN: set = set()  # (kernel, dtype, D, Dv[, Sk]) whose ATen op raised here
_LAST = ["math"]


def last_kernel() -> str:
    """The kernel the last ``attention_with_lse`` call in this process ran (one of
    ``KERNELS``)."""
    return _LAST[0]


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``x [B, H, S, D]`` with ``Hkv`` heads → ``heads`` heads (KV head j serves query heads
    ``[j·m, (j+1)·m)``)."""
    hkv = x.shape[1]
    return x if hkv == heads else x.repeat_interleave(heads // hkv, dim=1)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        scale: float | None = None, key_padding_mask: torch.Tensor | None = None):
    """Attention with LSE in fp32 math (any device).

    Arguments:
        q: ``[B, Sq, Hq, D]``; k: ``[B, Sk, Hkv, D]``; v: ``[B, Sk, Hkv, Dv]``; any float dtype,
            ``Hq % Hkv == 0``.
        causal: mask key j > query i (needs ``Sq == Sk``).
        scale: score scale (None: ``1/√D``).
        key_padding_mask: bool ``[B, Sk]`` (True = attend) or None: a masked key's score is
            −inf, the same rule as a −inf bias carried in k.

    Returns:
        ``out [B, Sq, Hq, Dv]`` fp32, ``lse [B, Sq, Hq]`` fp32 (base e). A row with no
        key (``Sk == 0``, or every key masked) gets ``out = 0`` and ``lse = −inf``; a key
        whose score is −inf (e.g. a −inf bias carried in k) weighs exactly 0.

    Every operand is copied to a dense ``[B, H, S, D]`` fp32 tensor first, so the bits depend on
    the values and shapes only, not on the inputs' strides.
    """
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    if causal and sq != sk:
        raise ValueError(f"causal attention needs a square block, got Sq = {sq}, Sk = {sk}")
    qf = q.transpose(1, 2).to(torch.float32).contiguous()
    kf = _expand_kv(k.transpose(1, 2).to(torch.float32), hq).contiguous()
    vf = _expand_kv(v.transpose(1, 2).to(torch.float32), hq).contiguous()
    s = torch.matmul(qf, kf.transpose(-1, -2)) * (scale if scale is not None
                                                 else 1.0 / math.sqrt(d))
    if causal:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    if key_padding_mask is not None:
        s = s.masked_fill(~key_padding_mask.bool()[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, H, Sq]; −inf for a row without a key
    # A finite stand-in on empty rows: exp(−inf − 0) = 0, no NaN from −inf − (−inf).
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    out = torch.matmul(p, vf)
    return out.transpose(1, 2), lse.transpose(1, 2)


def _fused_choice(qt, kt, vt, causal: bool) -> str:
    """The kernel SDPA would pick for ``[B, H, S, D]`` operands (``"math"`` when none fits)."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return "flash"
    try:
        code = int(choose(qt, kt, vt, None, 0.0, causal))
    except Exception:  # noqa: BLE001 - a torch whose signature differs: try the fused order
        return "flash"
    backend = getattr(torch.nn.attention, "SDPBackend", None)
    names = {}
    if backend is not None:
        names = {int(backend.FLASH_ATTENTION): "flash",
                 int(backend.EFFICIENT_ATTENTION): "efficient",
                 int(getattr(backend, "CUDNN_ATTENTION", -99)): "cudnn"}
    return names.get(code, "math")


def _run_fused(kind: str, qt, kt, vt, causal: bool, bias=None):
    """``out [B, H, Sq, Dv]``, ``lse [B, H, Sq]`` fp32 from the ATen op of ``kind`` (``bias``:
    an additive ``[B, H, Sq, Sk]`` score bias, for the efficient and cuDNN kernels)."""
    aten = torch.ops.aten
    sq = qt.shape[2]
    if kind == "flash":
        res = aten._scaled_dot_product_flash_attention.default(qt, kt, vt, 0.0, causal, False)
        return res[0], res[1]
    if kind == "efficient":
        res = aten._scaled_dot_product_efficient_attention.default(qt, kt, vt, bias, True, 0.0,
                                                                   causal)
        return res[0], res[1][..., :sq]
    res = aten._scaled_dot_product_cudnn_attention.default(qt, kt, vt, bias, True, 0.0, causal,
                                                           False)
    lse = res[1]
    return res[0], lse.reshape(lse.shape[0], lse.shape[1], -1)[..., :sq]


#: (device, dtype, [B, H, Sq, D], Sk, Dv, causal) → the kernels to try, in order (SDPA's choice
#: first); asked once per shape, so a steady-state call does not pay ``_fused_sdp_choice``.
_ORDER: dict = {}


def _order(qt, kt, vt, causal: bool) -> tuple:
    key = (qt.device, qt.dtype, tuple(qt.shape), kt.shape[2], vt.shape[3], causal)
    order = _ORDER.get(key)
    if order is None:
        first = _fused_choice(qt, kt, vt, causal)
        order = tuple(([first] if first != "math" else [])
                      + [x for x in _FUSED_ORDER if x != first])
        if len(_ORDER) > 256:
            _ORDER.clear()
        _ORDER[key] = order
    return order


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, *,
                       key_padding_mask: torch.Tensor | None = None, segments=None):
    """The default ``attn_fn`` of ``ring_attention``: ``(out [B, Sq, Hq, Dv], lse [B, Sq, Hq]
    fp32)``, ``out`` in q's dtype from a fused kernel, fp32 from the math path — see the module
    docstring for the kernel it runs.

    ``key_padding_mask``: bool ``[B, Sk]`` (True = attend) or None. ``segments``: None, or the
    block's ``Segment`` tuples (``ring/layout.py``: query rows ``[q_lo, q_hi)`` attend key rows
    ``[k_lo, k_hi)``, causally or not), each computed on its own rows (the mask's keys of the
    segment with it); rows outside every segment are 0 with LSE −inf. A row whose keys are all
    masked is 0 with LSE −inf."""
    if segments is not None:
        return _segments(q, k, v, key_padding_mask, segments)
    if key_padding_mask is not None:
        return masked_attention(q, k, v, causal, key_padding_mask)
    if not q.is_cuda or q.shape[0] == 0 or q.shape[1] == 0 or k.shape[1] == 0:
        return _math(q, k, v, causal)
    hq = q.shape[2]
    qt = q.transpose(1, 2)
    kt = _expand_kv(k.transpose(1, 2), hq)
    vt = _expand_kv(v.transpose(1, 2), hq)
    key = (q.dtype, q.shape[3], v.shape[3])
    for kind in _order(qt, kt, vt, causal):
        res = _attempt((kind, *key), lambda: _run_fused(kind, qt, kt, vt, causal))  # noqa: B023
        if res is not None:
            _LAST[0] = kind
            return res[0].transpose(1, 2), res[1].transpose(1, 2)
    return _math(q, k, v, causal)


def _attempt(key, call):
    """``call()``, or None when the kernel it runs refused these tensors, now or before
    (``_BROKEN`` remembers ``key``: that kernel is never asked again for it)."""
    if key in _BROKEN:
        return None
    try:
        return call()
    except torch.OutOfMemoryError:
        raise
    except RuntimeError:  # this kernel does not take these tensors
        _BROKEN.add(key)
        return None


def _segments(q, k, v, key_padding_mask, segments):
    """The block's segments into one result (rows of no segment empty): one segment over the
    whole block is the dense call; on CUDA without a mask, FlashAttention's variable-length
    kernel (``_varlen``: one launch per causal flag); else one by one into an fp32 result."""
    b, sq, hq, _ = q.shape
    if len(segments) == 1 and tuple(segments[0][:4]) == (0, sq, 0, k.shape[1]):
        # one segment over the whole block: the dense call (the fastest kernel SDPA has)
        return attention_with_lse(q, k, v, bool(segments[0][4]),
                                  key_padding_mask=key_padding_mask)
    if key_padding_mask is None and q.is_cuda:
        res = _varlen(q, k, v, segments)
        if res is not None:
            return res
    out = torch.zeros(b, sq, hq, v.shape[3], dtype=torch.float32, device=q.device)
    lse = torch.full((b, sq, hq), float("-inf"), dtype=torch.float32, device=q.device)
    for seg in segments:
        q_lo, q_hi, k_lo, k_hi, causal = seg
        mask = None if key_padding_mask is None else key_padding_mask[:, k_lo:k_hi]
        o, l_ = attention_with_lse(q[:, q_lo:q_hi], k[:, k_lo:k_hi], v[:, k_lo:k_hi], causal,
                                   key_padding_mask=mask)
        out[:, q_lo:q_hi] = o
        lse[:, q_lo:q_hi] = l_
    return out, lse


class _VarlenPlan:
    """A block's segments as FlashAttention variable-length batches over the flattened
    ``[B·Sq]`` query and ``[B·Sk]`` key rows, one batch list per causal flag. The rows between
    segments become entries with no keys or no queries (never both), so the kernel reads the
    tensors in place; ``rows[c]`` marks the query rows of flag ``c``'s segments, ``live`` the
    query rows of any segment."""

    def __init__(self, segments, b: int, sq: int, sk: int, device):
        self.launches = []
        live = torch.zeros(b * sq, dtype=torch.bool)
        for flag in (False, True):
            segs = sorted(tuple(x) for x in segments if bool(x[4]) == flag)
            if not segs:
                continue
            cu_q, cu_k, rows = [0], [0], torch.zeros(b * sq, dtype=torch.bool)

            def gap(q_to, k_to):  # rows up to q_to with no keys, then keys up to k_to alone
                if q_to > cu_q[-1]:
                    cu_q.append(q_to)
                    cu_k.append(cu_k[-1])
                if k_to > cu_k[-1]:
                    cu_q.append(cu_q[-1])
                    cu_k.append(k_to)

            for i in range(b):
                oq, ok = i * sq, i * sk
                for q_lo, q_hi, k_lo, k_hi, _ in segs:
                    if oq + q_lo < cu_q[-1] or ok + k_lo < cu_k[-1]:
                        raise ValueError(f"segments overlap: {segs}")
                    gap(oq + q_lo, ok + k_lo)
                    cu_q.append(oq + q_hi)
                    cu_k.append(ok + k_hi)
                    rows[oq + q_lo:oq + q_hi] = True
                gap(oq + sq, ok + sk)
            lens_q = [y - x for x, y in zip(cu_q, cu_q[1:])]
            lens_k = [y - x for x, y in zip(cu_k, cu_k[1:])]
            self.launches.append((flag, torch.tensor(cu_q, dtype=torch.int32, device=device),
                                  torch.tensor(cu_k, dtype=torch.int32, device=device),
                                  max(lens_q), max(lens_k), rows.to(device)))
            live |= rows
        self.live = live.to(device)


@functools.lru_cache(maxsize=256)
def _varlen_plan(segments: tuple, b: int, sq: int, sk: int, device) -> _VarlenPlan:
    """The ``_VarlenPlan`` of a block, made on its first call (the ring makes a new block plan
    outside capture, so this host-to-device copy is outside it too)."""
    return _VarlenPlan(segments, b, sq, sk, device)


def _varlen_fits(q, k, v) -> bool:
    """Whether the variable-length kernels take the block: fp16/bf16, ``D = Dv`` a multiple of
    8 up to 256, nothing empty (a kernel that refuses an empty batch would be marked broken
    for the process)."""
    d = q.shape[3]
    return (q.dtype in (torch.float16, torch.bfloat16) and d == v.shape[3] and d % 8 == 0
            and d <= 256 and q.shape[0] > 0 and q.shape[1] > 0 and k.shape[1] > 0)


def _varlen(q, k, v, segments):
    """``_segments`` through ``aten._flash_attention_forward`` with cumulative sequence
    lengths (FlashAttention-2's varlen kernel: GQA in the kernel, no KV expansion), or None
    where it does not apply (dtype, head dims) or its op refused these tensors once."""
    b, sq, hq, d = q.shape
    sk, dv = k.shape[1], v.shape[3]
    key = ("flash-varlen", q.dtype, d)
    if not _varlen_fits(q, k, v) or key in _BROKEN:
        return None
    plan = _varlen_plan(tuple(tuple(x) for x in segments), b, sq, sk, q.device)
    qf, kf, vf = (x.reshape(-1, x.shape[2], x.shape[3]) for x in (q, k, v))
    out = lse = None
    for flag, cu_q, cu_k, max_q, max_k, rows in plan.launches:
        res = _attempt(key, lambda: _flash_varlen_run(qf, kf, vf, cu_q, cu_k, max_q,  # noqa: B023
                                                      max_k, flag))  # noqa: B023
        if res is None:
            return None
        o, l_ = res
        if l_ is None:  # a build whose LSE layout differs: not this path
            _BROKEN.add(key)
            return None
        out = o if out is None else torch.where(rows[:, None, None], o, out)
        lse = l_ if lse is None else torch.where(rows[:, None], l_, lse)
    _LAST[0] = "flash-varlen"
    # Rows of no segment are empty (the kernel leaves +inf as the LSE of a row without keys).
    dead = ~plan.live
    out = out.masked_fill(dead[:, None, None], 0.0)
    lse = lse.masked_fill(dead[:, None], float("-inf"))
    return out.view(b, sq, hq, dv), lse.view(b, sq, hq)


def compact_keys(key_padding_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A key-padding mask as the key order of a variable-length batch.

    ``key_padding_mask``: bool ``[B, Sk]`` (True = attend), any device. Returns ``order``
    ``[B·Sk]`` int64 and ``cu_k`` ``[B + 1]`` int32: gathering the flattened ``[B·Sk, ...]`` keys
    by ``order`` puts batch row b's attended keys, in their own order, at rows
    ``[cu_k[b], cu_k[b+1])`` (the masked keys follow, after ``cu_k[B]``). A stable sort of the
    flattened ``~mask``: fixed shapes, no host sync (so a CUDA graph can record it). Non-causal
    attention does not depend on the order of its keys, so the attention of row b over these
    keys is its masked attention (up to rounding)."""
    order = torch.sort((~key_padding_mask.bool()).reshape(-1).to(torch.uint8), stable=True)[1]
    counts = key_padding_mask.sum(1, dtype=torch.int32)
    return order, torch.nn.functional.pad(counts.cumsum(0, dtype=torch.int32), (1, 0))


def pack_masked(q, k, v, key_padding_mask):
    """``(qf [B·Sq, Hq, D], kf [B·Sk, Hkv, D], vf [B·Sk, Hkv, Dv], cu_q [B + 1], cu_k [B + 1])``:
    a block with a key-padding mask as a variable-length batch (``compact_keys``): query row
    ``b·Sq + i`` attends key rows ``[cu_k[b], cu_k[b+1])``; ``cu_q = b·Sq``. Any device."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    order, cu_k = compact_keys(key_padding_mask)
    kf = k.reshape(b * sk, k.shape[2], d).index_select(0, order)
    vf = v.reshape(b * sk, v.shape[2], v.shape[3]).index_select(0, order)
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
    return q.reshape(b * sq, hq, d), kf, vf, cu_q, cu_k


def masked_varlen(q, k, v, key_padding_mask):
    """Non-causal attention of one block with a key-padding mask on CUDA, as a variable-length
    batch (``pack_masked``: each batch row's attended keys gathered to the front; GQA stays in
    the kernel, no KV expansion) through FlashAttention-2's varlen kernel: ``(out [B, Sq, Hq,
    Dv] in q's dtype, lse [B, Sq, Hq] fp32)``, a batch row with no attended key 0 with LSE −inf.
    None where it does not apply (CPU, fp32, ``D ≠ Dv``, D not a multiple of 8 or above 256, an
    empty block) or the kernel refused these tensors (``_attempt``)."""
    if not q.is_cuda or not _varlen_fits(q, k, v):
        return None
    return _masked_varlen(q, k, v, key_padding_mask, "flash-varlen", _flash_varlen_run)


def _masked_varlen(q, k, v, key_padding_mask, kind: str, run):
    """``masked_varlen`` past its device and shape checks, through ``run(qf, kf, vf, cu_q, cu_k,
    max_q, max_k) -> (out [T_q, Hq, Dv], lse [T_q, Hq] or None)``, the varlen kernel ``kind``."""
    key = (kind, q.dtype, q.shape[3])
    if key in _BROKEN:
        return None
    b, sq, hq, _ = q.shape
    sk, dv = k.shape[1], v.shape[3]
    qf, kf, vf, cu_q, cu_k = pack_masked(q, k, v, key_padding_mask)
    res = _attempt(key, lambda: run(qf, kf, vf, cu_q, cu_k, sq, sk))
    if res is None:
        return None
    out, lse = res
    if lse is None:  # a build whose LSE layout is not one this code reads
        _BROKEN.add(key)
        return None
    _LAST[0] = kind
    # A batch row without a key is empty (the kernel leaves +inf as its LSE).
    empty = (cu_k[1:] == cu_k[:-1])[:, None, None]
    lse = lse.view(b, sq, hq).masked_fill(empty, float("-inf"))
    return out.view(b, sq, hq, dv).masked_fill(empty[..., None], 0.0), lse


def _flash_varlen_run(qf, kf, vf, cu_q, cu_k, max_q, max_k, causal: bool = False):
    """FlashAttention-2's varlen forward (``aten._flash_attention_forward``): ``(out [T_q, Hq,
    Dv], lse [T_q, Hq])``, ``lse`` None when the build's layout is not ``[Hq, T_q]``."""
    res = torch.ops.aten._flash_attention_forward.default(qf, kf, vf, cu_q, cu_k, max_q, max_k,
                                                          0.0, causal, False)
    lse = res[1]
    return res[0], (lse.t() if tuple(lse.shape) == (qf.shape[1], qf.shape[0]) else None)


def masked_attention(q, k, v, causal: bool, key_padding_mask):
    """One block with a key-padding mask (bool ``[B, Sk]``, True = attend): ``(out, lse)`` as
    ``attention_with_lse``. fp32 math on CPU. On CUDA, non-causal: a variable-length batch of
    each row's attended keys (``masked_varlen``); causal (a sort of the keys would lose the
    positions causality compares), or where that does not apply: the mask as a −inf bias to
    cuDNN's kernel, else the efficient one (``_masked_bias``). A row with no attended key is 0
    with LSE −inf."""
    if q.is_cuda and not causal:
        res = masked_varlen(q, k, v, key_padding_mask)
        if res is not None:
            return res
    return _masked_bias(q, k, v, causal, key_padding_mask)


def _masked_bias(q, k, v, causal: bool, key_padding_mask):
    """``masked_attention`` with the mask as a −inf bias broadcast over heads and queries
    (stride 0): cuDNN's kernel, else the efficient one (CUDA), else fp32 math."""
    if not q.is_cuda or q.shape[0] == 0 or q.shape[1] == 0 or k.shape[1] == 0:
        return _math(q, k, v, causal, key_padding_mask)
    hq, sq, sk = q.shape[2], q.shape[1], k.shape[1]
    qt = q.transpose(1, 2)
    kt = _expand_kv(k.transpose(1, 2), hq)
    vt = _expand_kv(v.transpose(1, 2), hq)
    keep = key_padding_mask.bool()
    bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(
        ~keep, float("-inf"))[:, None, None, :].expand(q.shape[0], hq, sq, sk)
    shape = (q.dtype, q.shape[3], v.shape[3], sk)
    for kind in ("cudnn", "efficient"):
        res = _attempt((kind + "-masked", *shape), lambda: _run_fused(  # noqa: B023
            kind, qt, kt, vt, causal, bias))
        if res is not None:
            break
    else:
        return _math(q, k, v, causal, key_padding_mask)
    _LAST[0] = kind
    out, lse = res[0].transpose(1, 2), res[1].transpose(1, 2)
    # A row without a key is empty whatever the kernel wrote there.
    has = keep.cumsum(1)[:, :sq] > 0 if causal else keep.any(1, keepdim=True).expand(-1, sq)
    has = has[:, :, None]
    return out.masked_fill(~has[..., None], 0.0), lse.masked_fill(~has, float("-inf"))


def _math(q, k, v, causal: bool, key_padding_mask=None):
    """``reference_attention``, recorded as the kernel that ran."""
    _LAST[0] = "math"
    return reference_attention(q, k, v, causal, key_padding_mask=key_padding_mask)
