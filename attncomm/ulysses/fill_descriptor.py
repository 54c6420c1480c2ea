"""The Ulysses fill kernel's descriptor: its int64 words (layout in ``fill_kernels``' module
docstring) for one layout at given region starts and strides, uploaded once and cached on the
device, so a steady-state fill copies nothing to the device; inside CUDA graph capture, where no
host-to-device copy can run, derived on the device from a cached one (``derived_table``).
``fill.FillPlan`` keeps the descriptors of its layouts.
"""
from __future__ import annotations

import collections
import struct
from typing import NamedTuple

import torch

from .. import _triton
from ..compiled_launch import capturing

if _triton.REASON is None:
    from . import fill_kernels as _fk
else:
    _fk = None

__all__ = ["Desc", "descriptor", "device_table", "derived_table", "spec_code", "usable"]

#: ``layout key → Desc`` (the kernel's int64 descriptor on the device), built once per layout,
#: so a steady-state fill uploads nothing (no host↔device copy in a forward).
_TABLES: collections.OrderedDict = collections.OrderedDict()


class Desc(NamedTuple):
    """One descriptor on the device, with what the launch reads of it."""

    table: torch.Tensor   # the descriptor (fill_kernels' module docstring)
    entries: int          # entries, the kernel's ENTRIES (programs per row block)
    aligned: bool         # every base and pitch a multiple of 16 elements
    spec: int             # the kernel's SPEC
    words: tuple          # the same words on the host (``derived_table`` reads them)
    full: bool            # every entry has ``hb`` heads
    # a captured derived table's source, which every replay copies: kept while this one is
    source: torch.Tensor | None = None


def spec_code(stride: int) -> int:
    """What the launcher finds for an integer argument: 1 (it is 1), 2 (a multiple of 16), 0."""
    return 1 if stride == 1 else 2 if stride % 16 == 0 else 0


def descriptor(device, ranges, htot, starts, batch, row, hb, s_r, eps, flags, strides,
                rope_strides) -> Desc:
    """The fill kernel's descriptor (``fill_kernels``): a header (``s_r``, ``eps``'s fp32 bits,
    ``flags``, cos/sin ``rope_strides``), then one entry per (part, destination, run of up to
    ``hb`` consecutive heads of the part that the destination takes): ``part, first head,
    heads, base element, row pitch, batch pitch`` (``starts[p]``: region p's first element
    from the kernel's base pointer; ``row`` elements per (token, head): ``D``, or ``D + 4``
    bytes for the FP8 payload) and the part's ``strides`` (batch, row, head, element). A
    KV head that several destinations take (GQA) is in one entry per destination: read once
    for each. Cached per layout."""
    key = (device, ranges, htot, starts, batch, row, hb, s_r, eps, flags, strides, rope_strides)
    desc = _TABLES.get(key)
    if desc is not None and usable(desc, device):
        _TABLES.move_to_end(key)
        return desc
    ents, cols = [], [0] * len(htot)
    for i, rng in enumerate(ranges):
        for p, (lo, hi) in enumerate(rng):
            for h in range(lo, hi, hb):
                ents.append((i, h, min(hb, hi - h), starts[p] + (cols[p] + h - lo) * row,
                             batch * htot[p] * row, htot[p] * row, *strides[i]))
            cols[p] += max(0, hi - lo)
    head = [0] * _fk.HEADER
    head[_fk.H_S], head[_fk.H_FLAGS] = s_r, flags
    head[_fk.H_EPS] = struct.unpack("<i", struct.pack("<f", eps))[0]
    head[_fk.H_COS_S:_fk.H_SIN_D + 1] = rope_strides
    # one code per stride position, shared by the parts (where they differ: nothing known)
    codes = [c.pop() if len(c := {spec_code(st[k]) for st in strides}) == 1 else 0
             for k in range(4)] + [spec_code(v) for v in rope_strides]
    words = head + [v for e in ents for v in e]
    table, source = device_table(words, device)
    desc = Desc(table, len(ents), all(v % 16 == 0 for e in ents for v in e[3:6]),
                 sum(c << (2 * k) for k, c in enumerate(codes)), tuple(words),
                 all(e[2] == hb for e in ents), source)
    _TABLES[key] = desc
    while len(_TABLES) > 256:
        _TABLES.popitem(last=False)
    return desc


def usable(desc: Desc, device) -> bool:
    """Whether a cached descriptor may be launched with now: an uploaded one always, one derived
    inside capture only while capturing (its words are written when its graph replays)."""
    return desc.source is None or capturing(device)


def device_table(words: list, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(table, source)``: ``words`` as an int64 tensor on ``device``, uploaded (source
    None), or inside CUDA graph capture (where no host-to-device copy can run) derived from a
    cached table of the same length, its source (``derived_table``)."""
    device = torch.device(device)
    if capturing(device):
        return derived_table(words, device)
    return torch.tensor(words, dtype=torch.int64).to(device), None


def derived_table(words, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(table, source)``: a descriptor holding ``words``, made on the device from the most
    recent cached descriptor of the same length (the same layout at other region starts: a
    transport hands out its send buffers by parity, and the capture after one eager call
    takes the other): a copy of ``source`` with each word that differs set by a fill of a
    constant, so it needs no host-to-device copy and can be captured. The graph repeats the
    copy and the fills on every replay, so the caller keeps ``source`` as long as ``table``.

    Raises ValueError when no such descriptor is cached (warm the shape up eagerly)."""
    device = torch.device(device)
    for d in reversed(list(_TABLES.values())):
        # an uploaded one: a derived table holds its words only once its graph has replayed
        if d.source is None and d.table.device == device and len(d.words) == len(words):
            table = d.table.clone()
            for i, (old, new) in enumerate(zip(d.words, words)):
                if old != new:
                    table[i].fill_(new)
            return table, d.table
    raise ValueError("ulysses fill: a new layout first seen inside CUDA graph capture, where "
                     "its descriptor cannot be uploaded: run this call shape eagerly before "
                     "capturing")
