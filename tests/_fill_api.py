"""The fill as one-shot calls for the tests (the library's one entry point is ``FillPlan``):
``fill_triton`` (the kernel, any launch shape) and ``fill`` (``impl`` chosen as ``FillPlan``'s),
each a ``FillPlan`` made for the call and run once, returning ``out`` (a new flat send buffer
when None)."""
from __future__ import annotations

import torch

from attncomm.ulysses import fp8
from attncomm.ulysses.fill import FillPlan, send_layout


def _out(parts, payload_dtype):
    x = parts[0].x
    b, s_r, _, d = x.shape
    packed = fp8.is_fp8_payload(payload_dtype, x.dtype)
    row = fp8.row_bytes(d) if packed else d
    _, starts = send_layout(b, s_r, row, [p.ranges for p in parts])
    return torch.empty(starts[-1], dtype=fp8.WIRE_DTYPE if packed else x.dtype, device=x.device)


def fill(parts, eps=0.0, cos=None, sin=None, out=None, impl="auto", *, payload_dtype=None,
         **launch):
    plan = FillPlan(parts, eps, cos is not None, impl, payload_dtype, **launch)
    out = _out(parts, payload_dtype) if out is None else out
    plan([p.x for p in parts], cos, sin, out)
    return out


def fill_triton(parts, eps=0.0, cos=None, sin=None, out=None, *, payload_dtype=None, **launch):
    return fill(parts, eps, cos, sin, out, "triton", payload_dtype=payload_dtype, **launch)
