"""One forward shape of ``UlyssesAttention``, planned once and run many times.

A ``ForwardPlan`` holds everything a forward of one shape needs that does not depend on the
data: the head groups and their ranges, every exchange's plan and transport (decided when the
plan is made, eagerly), the prepared fills, the views of each receive buffer, the KV head index
for a rank whose grouping is not uniform. ``run`` then only allocates the output, launches the
fills, starts and waits for the exchanges, and calls ``attn_fn``: the same work a CUDA graph of
the forward replays, so a plan made by an eager warm-up call is what a capture records.

Schedule of a forward with G head groups (one stream; the exchanges run on the transport's
streams or copy engines)::

    fill(0) send(0) | fill(1) send(1) wait(0) attend(0) out(0) | fill(2) send(2) wait(1) ...

Group g+1's fill (norm + RoPE + pack, ``ulysses/fill.py``) and exchange are enqueued before
group g's wait and attention, so the fill runs while group g's data is in flight and the
exchange under group g's attention; nothing here waits for the GPU on the host (no event
polling, ``.item()`` or synchronize), so the host can run ahead of the GPU.
"""
from __future__ import annotations

import dataclasses

import torch

from .fill import FillPart, FillPlan, rms_norm_rope
from .layout import (ExchangePlan, group_head_ranges, head_offsets, head_to_seq_plan,
                     kv_head_range, seq_to_head_plan, uniform_group)
from .policy import dense, get_transport
from .transport import Transport

__all__ = ["ForwardPlan"]

_PARTS = {"q": 0, "k": 1, "v": 2}


@dataclasses.dataclass
class _In:
    """One input exchange of a head group: q, k, v parts that share dtype and head_dim."""

    plan: ExchangePlan
    dtype: torch.dtype
    transport: Transport
    parts: tuple        # indices into (q, k, v)
    views: tuple        # per part: (size, stride, offset) of its view of the receive buffer
    fill: FillPlan | None
    store: tuple | None = None   # (storage index, first element, elements) of its send buffer


@dataclasses.dataclass
class _Group:
    ins: list
    out_plan: ExchangePlan
    out_transport: Transport
    heads: int          # this rank's query heads in the group
    idx: torch.Tensor | None   # KV head per query head when the grouping is not uniform


class ForwardPlan:
    """A forward of ``UlyssesAttention`` for one shape (see the module docstring).

    Arguments:
        mod: the module (its ``attn_fn``, ``qk_norm``, ``fuse_qk_norm_rope``, ``fill_impl``).
        group: the resolved process group; ``rank``, ``world``: this rank and W.
        dims: ``(B, Hq, Hkv, D, Dv)``; ``seq``: every rank's ``S_r``.
        backend: the agreed transport request; ``timeout``: seconds.
        n_groups: head groups (1: sequential), agreed.
        q, k, v: tensors of the shape (their shapes, dtypes and device fix the plan).
        rope: whether cos/sin are passed; ``causal``: for ``attn_fn``.

    Attributes:
        fallback_reason, backends, in_exchanges, n_groups: what the module reports.
    """

    def __init__(self, mod, group, rank, world, dims, seq, backend, timeout, n_groups,
                 q, k, v, rope: bool, causal: bool):
        b, hq, hkv, d, dv = dims
        self.attn_fn = mod.attn_fn
        self.qk_norm = mod.qk_norm
        self.fuse = mod.fuse_qk_norm_rope
        self.causal = bool(causal)
        self.n_groups = n_groups
        self.s_total = sum(seq)
        self.off, self.s_r = head_offsets(seq)[rank], seq[rank]
        self.out_shape = (b, seq[rank], hq, dv)
        self.dv = dv
        self.fallback_reason = None
        self.backends: dict = {}
        self._rope_src = self._rope_rows = None
        m = hq // hkv
        eps = float(self.qk_norm[2]) if self.qk_norm is not None else 0.0
        self.eps = eps
        qranges = group_head_ranges(hq, world, n_groups)
        ctx = (group, backend, timeout, b, tuple(seq), rank, q.device)
        self.groups = []
        for qr in qranges:
            kvr = tuple(kv_head_range(lo, hi, m) for lo, hi in qr)
            ins = self._ins(ctx, (q, k, v), (tuple(qr), kvr, kvr), mod.fill_impl, rope, eps)
            out_plan = head_to_seq_plan(b, tuple(seq), dv, tuple(hi - lo for lo, hi in qr),
                                        tuple(lo for lo, _ in qr), hq)
            t, dec = get_transport(group, backend, q.device, timeout, out_plan, q.dtype,
                                   "UlyssesAttention")
            self._note(dec, "out", t)
            q_lo, q_hi = qr[rank]
            idx = None
            if q_hi > q_lo and not uniform_group(q_lo, q_hi, m):
                kv_lo = kv_head_range(q_lo, q_hi, m)[0]
                idx = torch.tensor([h // m - kv_lo for h in range(q_lo, q_hi)], device=q.device)
            self.groups.append(_Group(ins, out_plan, t, q_hi - q_lo, idx))
        self.in_exchanges = len(self.groups[0].ins)
        self.stores = self._stores()

    def _stores(self) -> list:
        """One allocation per dtype per forward for every input exchange's send buffer whose
        transport takes caller memory (``Transport.send_storage``): ``[(dtype, elements)]``,
        each exchange's place in it recorded in its ``store``."""
        sizes: dict = {}
        for grp in self.groups:
            for e in grp.ins:
                n = e.transport.send_storage(e.plan) if e.fill is not None else 0
                if n:
                    i = list(sizes).index(e.dtype) if e.dtype in sizes else len(sizes)
                    off = sizes.get(e.dtype, 0)
                    e.store = (i, off, n)
                    sizes[e.dtype] = off + n
        return list(sizes.items())

    def _note(self, decision, side: str, t: Transport) -> None:
        self.backends[side] = t.name
        if decision.fallback_reason is not None:
            self.fallback_reason = decision.fallback_reason

    def _ins(self, ctx, qkv, ranges, fill_impl, rope, eps) -> list:
        """The input exchanges of one head group: q, k, v in one exchange when their dtype and
        head_dim agree (else one per (dtype, D)), each with its prepared fill."""
        group, backend, timeout, b, seq, rank, device = ctx
        keyed: dict = {}
        for i, (t, r) in enumerate(zip(qkv, ranges)):
            keyed.setdefault((t.dtype, t.shape[3]), []).append((i, r))
        qw, kw = (self.qk_norm[0], self.qk_norm[1]) if self.qk_norm is not None else (None, None)
        weights = (qw, kw, None)
        out = []
        for (dtype, dd), items in keyed.items():
            plan = seq_to_head_plan(b, seq, dd, tuple(r for _, r in items))
            t, dec = get_transport(group, backend, device, timeout, plan, dtype,
                                   "UlyssesAttention")
            self._note(dec, "in", t)
            fill = None
            if self.fuse:
                parts = [FillPart(qkv[i], r, weights[i], rope and i < 2) for i, r in items]
                fill = FillPlan(parts, eps, rope, fill_impl)
            htot = sum(r[rank][1] - r[rank][0] for _, r in items)
            views, col = [], 0
            for _, r in items:
                n = r[rank][1] - r[rank][0]
                views.append(((b, self.s_total, n, dd), (htot * dd, b * htot * dd, dd, 1),
                              col * dd))
                col += n
            out.append(_In(plan, dtype, t, tuple(i for i, _ in items), tuple(views), fill))
        return out

    # ------------------------------------------------------------------------------ run
    def run(self, q, k, v, rope):
        """One forward: ``[B, S_r, Hq, Dv]``, a new tensor. Group g+1's fill and exchange are
        enqueued before group g's attention; each group's output reaches the final tensor
        through the transport (a copy out of its staging or receive buffer, docs/DESIGN.md).
        Pipelined and sequential runs give the same bits."""
        rows = self._rows(rope)
        if not self.fuse:  # norm/rope as their own pass over the local shard
            q, k = self._norm_rope(q, k, rows)
            q, k, v = dense(q), dense(k), dense(v)
        qkv = (q, k, v)
        dev = q.device
        out = torch.empty(self.out_shape, dtype=q.dtype, device=dev)
        flat = out.view(-1)
        stores = [torch.empty(n, dtype=dt, device=dev) for dt, n in self.stores]
        groups, n = self.groups, self.n_groups
        pending = []
        ex_in = self._start_in(groups[0], qkv, rows, stores)
        for g in range(n):
            # group g+1's fill and exchange first: the fill runs while group g's data is in
            # flight, its exchange under group g's attention
            nxt = self._start_in(groups[g + 1], qkv, rows, stores) if g + 1 < n else None
            grp = groups[g]
            views = [None, None, None]
            for e, ex in zip(grp.ins, ex_in):
                buf = ex.wait()
                base = buf.storage_offset()
                for i, (size, stride, off) in zip(e.parts, e.views):
                    views[i] = buf.as_strided(size, stride, base + off)
            og = self._attend(grp, *views)
            for ex in ex_in:
                ex.release()
            pending.append(grp.out_transport.start(grp.out_plan, [og], og.dtype, og.device,
                                                   out=flat))
            if len(pending) > 1:  # at most two output exchanges in flight (two slots)
                done = pending.pop(0)
                done.wait()
                done.release()
            ex_in = nxt
        for ex in pending:
            ex.wait()
            ex.release()
        return out

    def _rows(self, rope):
        """cos/sin rows of this rank's positions (kept while the same tensors come back)."""
        if rope is None:
            return None
        cos, sin = rope
        src = self._rope_src
        if src is None or src[0] is not cos or src[1] is not sin:
            lo, hi = self.off, self.off + self.s_r
            self._rope_src, self._rope_rows = (cos, sin), (cos[lo:hi], sin[lo:hi])
        return self._rope_rows

    def _norm_rope(self, q, k, rows):
        """RMSNorm + RoPE of q and k (``rows``: cos/sin for their sequence positions)."""
        if self.qk_norm is None and rows is None:
            return q, k
        qw, kw = (self.qk_norm[0], self.qk_norm[1]) if self.qk_norm is not None else (None, None)
        cs, sn = rows if rows is not None else (None, None)
        return (rms_norm_rope(q, qw, self.eps, cs, sn), rms_norm_rope(k, kw, self.eps, cs, sn))

    def _start_in(self, grp: _Group, qkv, rows, stores) -> list:
        """Start the input exchanges of one head group: with the fused fill, the fill packs
        each exchange's send buffer (norm + RoPE on the way) and the transport sends it as it
        is; otherwise the transport packs from q, k, v."""
        exs = []
        cos, sin = rows if rows is not None else (None, None)
        for e in grp.ins:
            t, dev = e.transport, qkv[0].device
            xs = [qkv[i] for i in e.parts]
            if e.fill is not None:
                st = e.store
                mem = None if st is None else stores[st[0]][st[1]:st[1] + st[2]]
                send = t.send_buffer(e.plan, e.dtype, dev, mem)
                e.fill(xs, cos, sin, send.flat if send.flat is not None else send.regions)
                exs.append(t.start(e.plan, (), e.dtype, dev, send=send))
            else:
                exs.append(t.start(e.plan, xs, e.dtype, dev))
        return exs

    def _attend(self, grp: _Group, qg, kg, vg):
        """``attn_fn`` on this rank's heads of one group, with the KV heads expanded to one per
        query head when the rank's grouping is not uniform."""
        if grp.heads == 0 or self.s_total == 0:
            return qg.new_empty(qg.shape[0], self.s_total, grp.heads, self.dv)
        if grp.idx is not None:
            kg, vg = kg.index_select(2, grp.idx), vg.index_select(2, grp.idx)
        return dense(self.attn_fn(qg, kg, vg, self.causal))
