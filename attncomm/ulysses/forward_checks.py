"""The local argument checks of ``UlyssesAttention.forward`` (no communication): q, k, v,
``seq_lens``, ``rope``, ``qk_norm``, the joint rows and the payload dtype. Each returns an error
message (or None) that the caller then agrees across ranks (``_agree.validate_args``), so a bad
argument on one rank raises the same ``ValueError`` on every rank.

Joint rows (``joint=(q_j, k_j, v_j)``) are replicated: every rank must pass the
same bits. Their agreement is a checksum in the call's signature (``joint_checksum``: CRC-32 of
the three tensors' bytes), computed only when the call is checked (first sight of a signature,
or every call with ``validate=True``), since it reads the joint rows on the host.
"""
from __future__ import annotations

import zlib

import torch

from . import fp8
from ..ring.api import key_mask_error
from .policy import _seq_lens_error

__all__ = ["JOINT_POSITIONS", "qkv_error", "mask_error", "joint_error",
           "payload_error", "joint_checksum",
           "joint_key"]

#: Where the joint rows sit in the sequence attention runs over: ``[joint; sequence]`` or
#: ``[sequence; joint]``.
JOINT_POSITIONS = ("front", "back")


def qkv_error(q, k, v, seq, rope, qk_norm, world: int, rank: int, error):
    """``(error or None, (B, S_r, Hq, Hkv, D, Dv), seq)`` for q, k, v, ``seq`` (every rank's
    ``S_r`` or None: all equal to this rank's), ``rope`` and ``qk_norm``; the dims all 0 when
    q, k, v are not 4-D tensors. ``error``: an earlier error, kept first."""
    tens = [t for t in (q, k, v) if isinstance(t, torch.Tensor)]
    if len(tens) != 3 or any(t.dim() != 4 for t in tens):
        got = ", ".join(
            f"{n} {list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
            for n, t in zip("qkv", (q, k, v)))
        error = error or f"q, k, v must be 4-D tensors [B, S_r, H, D], got {got}"
        return error, (0,) * 6, seq
    b, s_r, hq, d = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    if error is None:
        if hq < 1 or hkv < 1:
            error = f"need at least one head: Hq = {hq}, Hkv = {hkv}"
        elif hq % hkv:
            error = f"Hq % Hkv != 0: Hq = {hq}, Hkv = {hkv}"
        elif k.shape[:2] != (b, s_r) or v.shape[:3] != k.shape[:3]:
            error = (f"shapes disagree: q {list(q.shape)}, k {list(k.shape)}, "
                     f"v {list(v.shape)} (need the same B, S_r; k, v the same Hkv)")
        elif k.shape[3] != d:
            error = f"q has D = {d} but k has D = {k.shape[3]}"
        elif len({t.device for t in tens}) != 1:
            error = f"q, k, v are on different devices: {[str(t.device) for t in tens]}"
    if seq is None:
        seq = (s_r,) * world
    elif error is None:
        error = _seq_lens_error(seq, world)
        if error is None and seq[rank] != s_r:
            error = f"seq_lens[{rank}] = {seq[rank]} but q has S_r = {s_r}"
    if error is None and qk_norm is not None:
        qw, kw, _ = qk_norm
        if tuple(qw.shape) != (d,) or tuple(kw.shape) != (d,):
            error = (f"qk_norm weights must be [D] = [{d}], got {list(qw.shape)} and "
                     f"{list(kw.shape)}")
    if error is None and rope is not None:
        error = _rope_error(rope, (sum(seq), d))
    return error, (b, s_r, hq, hkv, d, dv), seq


def _rope_error(rope, want) -> str | None:
    try:
        cos, sin = rope
        shapes = (tuple(cos.shape), tuple(sin.shape))
    except (TypeError, ValueError, AttributeError):
        return f"rope must be (cos, sin) tensors [S, D] = {list(want)}, got {type(rope).__name__}"
    if shapes != (want, want):
        return (f"rope cos/sin must be [S, D] = {list(want)}, got {list(cos.shape)} and "
                f"{list(sin.shape)}")
    if want[1] % 2:
        return f"rope needs an even head_dim, got D = {want[1]}"
    return None


def joint_error(joint, position, causal, dims, qkv) -> tuple[str | None, int]:
    """``(error or None, S_j)`` for the joint rows: ``joint`` None (no joint rows: ``S_j`` −1)
    or ``(q_j [B, S_j, Hq, D], k_j [B, S_j, Hkv, D], v_j [B, S_j, Hkv, Dv])``, each of its
    counterpart's dtype and device (``qkv``: q, k, v), with ``position`` in ``JOINT_POSITIONS``
    and ``causal`` False (attention over the concatenation is non-causal). ``dims``: ``(B, S_r,
    Hq, Hkv, D, Dv)`` of q, k, v."""
    if position not in JOINT_POSITIONS:
        return (f"joint_position must be 'front' or 'back', got {position!r}",
                -1 if joint is None else 0)
    if joint is None:
        return None, -1
    try:
        qj, kj, vj = joint
    except (TypeError, ValueError):
        return (f"joint must be (q_j, k_j, v_j) tensors, got {type(joint).__name__}", 0)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (qj, kj, vj)):
        got = ", ".join(f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                        for t in (qj, kj, vj))
        return f"joint must be three 4-D tensors [B, S_j, H, D], got {got}", 0
    s_j = qj.shape[1]
    if causal:
        return ("causal=True with joint rows: attention over the joint rows and the sequence "
                "is non-causal"), s_j
    b, _, hq, hkv, d, dv = dims
    want = ((b, s_j, hq, d), (b, s_j, hkv, d), (b, s_j, hkv, dv))
    got = tuple(tuple(t.shape) for t in (qj, kj, vj))
    if got != want:
        return (f"joint shapes must be q_j {list(want[0])}, k_j {list(want[1])}, v_j "
                f"{list(want[2])} (q's B, Hq, D; k's Hkv; v's Dv), got "
                f"{', '.join(str(list(s)) for s in got)}"), s_j
    for name, t, ref in zip(("q", "k", "v"), (qj, kj, vj), qkv):
        if t.dtype != ref.dtype or t.device != ref.device:
            return (f"{name}_j is {t.dtype} on {t.device}, {name} is {ref.dtype} on "
                    f"{ref.device} (joint rows need their counterpart's dtype and device)"), s_j
    return None, s_j


def payload_error(payload_dtype, tensors) -> str | None:
    """Why ``payload_dtype`` cannot carry these tensors' exchange (None: it can, or it is
    None)."""
    if payload_dtype is None:
        return None
    for t in tensors:
        if isinstance(t, torch.Tensor):
            try:
                fp8.is_fp8_payload(payload_dtype, t.dtype)
            except ValueError as exc:
                return str(exc)
    return None


def joint_checksum(joint) -> int:
    """CRC-32 of the joint rows' bytes (q_j, k_j, v_j in turn; read on the host): equal on
    every rank exactly when the bits are (up to CRC collisions)."""
    crc = 0
    for t in joint:
        raw = t.detach().contiguous().view(-1).view(torch.uint8).cpu()
        crc = zlib.crc32(raw.numpy(), crc)
    return crc


def joint_key(joint):
    """The joint rows as they enter a plan key: None, or ``(shape, dtype, device)`` of each."""
    if joint is None:
        return None
    qj, kj, vj = joint
    return ((qj.shape, qj.dtype, qj.device), (kj.shape, kj.dtype, kj.device),
            (vj.shape, vj.dtype, vj.device))


def mask_error(masks, joint, dims6, s_j: int, q) -> str | None:
    """Why the key-padding masks ``(mask [B, S_r], joint mask [B, S_j])`` cannot be used, or
    None (None masks are none)."""
    mask, jmask = masks
    b, s_r = dims6[0], dims6[1]
    why = key_mask_error(mask, b, s_r, q.device)
    if why is None and jmask is not None:
        if joint is None:
            return "joint_key_padding_mask is given without joint rows"
        why = key_mask_error(jmask, b, s_j, q.device, "joint_key_padding_mask", "S_j")
    return why
