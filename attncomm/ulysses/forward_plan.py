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

One rank. With W = 1 an exchange moves nothing, so a pack that would only copy (no QK-norm or
RoPE inside the fill, no FP8 payload, no joint rows) is skipped: ``attn_fn`` reads q, k, v
themselves (its head group's slices of them), as it reads the parts' rows after an exchange;
one whose last two dims are not dense (``transport.dense``, e.g. a strided D) is copied first,
so ``attn_fn`` sees rows of heads × D as a receive buffer's views give them. With head groups
there is then nothing to overlap: each part is split once into the groups' heads and the
groups' outputs are concatenated once (``_run_local``), instead of one output exchange (a copy)
per group, when each part's groups take its heads in order (not for GQA groups sharing a KV
head, which take the general loop).

Landing buffer. With joint rows (``S_j`` replicated rows, e.g. a DiT's text tokens) or the FP8
payload, an input exchange's rows land in a buffer of the parts' dtype, ``[S_j + S, B, htot,
D]`` (``[S, B, htot, D]`` without joint rows), that attention reads: the exchanged rows at
``[S_j, S_j + S)`` (``"front"``) or ``[0, S)`` (``"back"``), a contiguous range of the buffer
because its layout is sequence-major, so ``all_to_all`` receives straight into it (``ce``
copies its slot there); the joint rows' heads this rank owns are copied into the other ``S_j``
rows from the caller's tensors; FP8 rows arrive as bytes and are dequantized into place
(``fp8.dequantize_packed``). Attention then runs over the concatenation with no further copy,
and its output's joint rows (``[B, S_j, h_r, Dv]`` on each rank) are gathered over heads in one
exchange (``layout.head_gather_plan``) after the last group, so every rank returns all heads.
"""
from __future__ import annotations

import dataclasses

import torch

from . import fp8 as _fp8
from .fill import FillPart, FillPlan, rms_norm_rope
from .layout import (ExchangePlan, group_head_ranges, head_gather_plan, head_offsets, head_split,
                     head_to_seq_plan, kv_head_range, seq_to_head_plan, uniform_group)
from .policy import get_transport
from .transport import Transport, dense

__all__ = ["ForwardPlan"]

_PARTS = {"q": 0, "k": 1, "v": 2}


@dataclasses.dataclass
class _In:
    """One input exchange of a head group: q, k, v parts that share dtype and head_dim."""

    plan: ExchangePlan
    dtype: torch.dtype  # what the transport moves: the parts' dtype, or uint8 (FP8 payload)
    src_dtype: torch.dtype      # the parts' dtype (what attention reads)
    transport: Transport
    parts: tuple        # indices into (q, k, v)
    # (size, stride) of the parts' view ``[B, rows, htot, D]`` of the receive buffer, and
    # each part's heads in it (side by side in part order; None for one part)
    view: tuple
    splits: list | None
    fill: FillPlan | None
    heads: tuple        # per part: this rank's heads (lo, hi) of it
    land: tuple | None  # (rows, B, htot, D) of the landing buffer, or None (no joint, no FP8)
    wire: tuple | None  # the FP8 receive buffer's shape (S, B, htot, D + 4), or None
    # (storage index, its slice or None for the whole storage) of its send buffer
    store: tuple | None = None
    # the transport moves nothing (``Transport.keeps_send_buffer``, no landing copy): the
    # filled storage is the received buffer, no exchange started
    direct: bool = False
    # one rank, and the pack would only copy (no norm or RoPE inside it, no FP8 payload, no
    # joint rows): attention reads the parts' own tensors, this group's heads of them
    local: bool = False


@dataclasses.dataclass
class _Group:
    ins: list
    out_plan: ExchangePlan
    out_transport: Transport
    heads: int          # this rank's query heads in the group
    idx: torch.Tensor | None   # KV head per query head when the grouping is not uniform


def _heads(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Heads ``[lo, hi)`` of ``x [B, S, H, D]``: ``x`` itself when they are all of them."""
    return x if lo == 0 and hi == x.shape[2] else x[:, :, lo:hi]


class ForwardPlan:
    """A forward of ``UlyssesAttention`` for one shape (see the module docstring).

    Arguments:
        mod: the module (its ``attn_fn``, ``qk_norm``, ``fuse_qk_norm_rope``, ``fill_impl``).
        group: the resolved process group; ``rank``, ``world``: this rank and W.
        dims: ``(B, Hq, Hkv, D, Dv)``; ``seq``: every rank's ``S_r``.
        facts: the transport choice's agreed facts (``policy.transport_facts``, probed before
            the plan is built: here each exchange's transport is only decided from them and
            built); ``timeout``: seconds.
        n_groups: head groups (1: sequential), agreed.
        q, k, v: tensors of the shape (their shapes, dtypes and device fix the plan).
        rope: whether cos/sin are passed; ``causal``: for ``attn_fn``.
        joint: ``(S_j, front)`` for joint rows (``S_j`` ≥ 0 rows at the front or the back), or
            None.
        payload_dtype: the module's ``payload_dtype`` (None, or ``torch.float8_e4m3fn``).

    Attributes:
        fallback_reason, backends, in_exchanges, n_groups: what the module reports;
        decision: the ``PipelineDecision`` behind ``n_groups`` (``pipeline_groups=-1``) or None.
    """

    def __init__(self, mod, group, rank, world, dims, seq, facts, timeout, n_groups,
                 q, k, v, rope: bool, causal: bool, joint: tuple | None = None,
                 payload_dtype=None):
        b, hq, hkv, d, dv = dims
        self.attn_fn = mod.attn_fn
        self.qk_norm = mod.qk_norm
        self.fuse = mod.fuse_qk_norm_rope
        self.payload_dtype = payload_dtype
        self.causal = bool(causal)
        self.n_groups = n_groups
        self.decision = None
        self.s_total = sum(seq)
        self.seq = tuple(seq)
        self.s_j, self.front = joint if joint is not None else (0, True)
        self.joint = joint is not None
        self.rows = self.s_j + self.s_total  # the rows attention runs over
        self.off, self.s_r = head_offsets(seq)[rank], seq[rank]
        self.out_shape = (b, seq[rank], hq, dv)
        self.dv = dv
        self.fallback_reason = None
        self.backends: dict = {}
        m = hq // hkv
        eps = float(self.qk_norm[2]) if self.qk_norm is not None else 0.0
        self.eps = eps
        qranges = group_head_ranges(hq, world, n_groups)
        ctx = (group, facts, timeout, b, tuple(seq), rank, q.device)
        self.groups = []
        for qr in qranges:
            kvr = tuple(kv_head_range(lo, hi, m) for lo, hi in qr)
            ins = self._ins(ctx, (q, k, v), (tuple(qr), kvr, kvr), mod.fill_impl, rope, eps)
            out_plan = head_to_seq_plan(b, tuple(seq), dv, tuple(hi - lo for lo, hi in qr),
                                        tuple(lo for lo, _ in qr), hq)
            t, dec = get_transport(group, facts.requested, q.device, timeout, out_plan,
                                   q.dtype, "UlyssesAttention", facts)
            self._note(dec, "out", t)
            q_lo, q_hi = qr[rank]
            idx = None
            if q_hi > q_lo and not uniform_group(q_lo, q_hi, m):
                kv_lo = kv_head_range(q_lo, q_hi, m)[0]
                idx = torch.tensor([h // m - kv_lo for h in range(q_lo, q_hi)], device=q.device)
            self.groups.append(_Group(ins, out_plan, t, q_hi - q_lo, idx))
        self.in_exchanges = len(self.groups[0].ins)
        self.all_local = all(e.local for grp in self.groups for e in grp.ins)
        self.local_splits = (self._local_splits((hq, hkv, hkv)) if self.all_local and n_groups > 1
                             else None)
        self.stores = self._stores()
        self.h_r = head_split(hq, world)[rank]
        self.joint_plan = self.joint_transport = None
        if self.joint and self.s_j > 0:
            self.joint_plan = head_gather_plan(b, self.s_j, dv, tuple(head_split(hq, world)))
            self.joint_transport, dec = get_transport(group, facts.requested, q.device,
                                                      timeout, self.joint_plan, q.dtype,
                                                      "UlyssesAttention", facts)
            self._note(dec, "joint", self.joint_transport)
        self.joint_shape = (b, self.s_j, hq, dv)
        # one rank and one head group: head_to_seq moves nothing, so attention's output (when
        # it is already a contiguous [B, S_r, Hq, Dv] tensor of q's dtype) is the result
        self.alone = world == 1 and n_groups == 1 and not self.joint

    def _local_splits(self, heads: tuple) -> list | None:
        """Per part of q, k, v (``heads``: how many each has): its heads' sizes in group
        order, when the groups' heads of every part follow one another from the first head to
        the last (so ``split_with_sizes`` gives each group's slice, an empty group an empty
        one, and the outputs' concatenation is the result); else None (GQA groups that share
        a KV head)."""
        ranges: list = [[], [], []]
        for grp in self.groups:
            for e in grp.ins:
                for i, r in zip(e.parts, e.heads):
                    ranges[i].append(r)
        sizes = []
        for rs, h in zip(ranges, heads):
            live = [(lo, hi) for lo, hi in rs if hi > lo]
            ends = [0] + [hi for _, hi in live]
            if len(rs) != len(self.groups) or [lo for lo, _ in live] + [h] != ends:
                return None
            sizes.append([hi - lo for lo, hi in rs])
        return sizes

    def _stores(self) -> list:
        """One allocation per dtype per forward for every input exchange's send buffer whose
        transport takes caller memory (``Transport.send_storage``): ``[(dtype, elements)]``,
        each exchange's place in it recorded in its ``store`` (no slice when it is the only
        one of its dtype)."""
        sizes: dict = {}
        users: dict = {}
        for grp in self.groups:
            for e in grp.ins:
                n = e.transport.send_storage(e.plan) if e.fill is not None else 0
                if n:
                    off = sizes.get(e.dtype, 0)
                    users.setdefault(e.dtype, []).append((e, slice(off, off + n)))
                    sizes[e.dtype] = off + n
        for i, found in enumerate(users.values()):
            for e, sl in found:
                e.store = (i, sl if len(found) > 1 else None)
                e.direct = ((e.land is None or e.wire is not None)
                            and e.transport.keeps_send_buffer(e.plan))
        return list(sizes.items())

    def _note(self, decision, side: str, t: Transport) -> None:
        self.backends[side] = t.name
        if decision.fallback_reason is not None:
            self.fallback_reason = decision.fallback_reason

    def _ins(self, ctx, qkv, ranges, fill_impl, rope, eps) -> list:
        """The input exchanges of one head group: q, k, v in one exchange when their dtype and
        head_dim agree (else one per (dtype, D)), each with its prepared fill (the fused fill,
        or the FP8 payload's, which also packs the unfused path's normed rows)."""
        group, facts, timeout, b, seq, rank, device = ctx
        # nothing to pack with one rank when the pack only copies (``_In.local``)
        copy_only = (len(seq) == 1 and not self.joint
                     and not (self.fuse and (self.qk_norm is not None or rope)))
        keyed: dict = {}
        for i, (t, r) in enumerate(zip(qkv, ranges)):
            keyed.setdefault((t.dtype, t.shape[3]), []).append((i, r))
        qw, kw = (self.qk_norm[0], self.qk_norm[1]) if self.qk_norm is not None else (None, None)
        weights = (qw, kw, None) if self.fuse else (None, None, None)
        out = []
        for (dtype, dd), items in keyed.items():
            fp8 = _fp8.is_fp8_payload(self.payload_dtype, dtype)
            part_ranges = tuple(r for _, r in items)
            if fp8:
                plan, wire = _fp8.payload_plan(b, seq, dd, part_ranges), _fp8.WIRE_DTYPE
            else:
                plan, wire = seq_to_head_plan(b, seq, dd, part_ranges), dtype
            t, dec = get_transport(group, facts.requested, device, timeout, plan, wire,
                                   "UlyssesAttention", facts)
            self._note(dec, "in", t)
            local = copy_only and not fp8
            fill = None
            if (self.fuse or fp8) and not local:
                parts = [FillPart(qkv[i], r, weights[i], self.fuse and rope and i < 2)
                         for i, r in items]
                fill = FillPlan(parts, eps, self.fuse and rope, fill_impl,
                                payload_dtype=self.payload_dtype if fp8 else None)
            splits = [r[rank][1] - r[rank][0] for _, r in items]
            htot = sum(splits)
            view = ((b, self.rows, htot, dd), (htot * dd, b * htot * dd, dd, 1))
            land = (self.rows, b, htot, dd) if self.joint or fp8 else None
            out.append(_In(plan, wire, dtype, t, tuple(i for i, _ in items), view,
                           splits if len(splits) > 1 else None, fill,
                           tuple(r[rank] for _, r in items), land,
                           (self.s_total, b, htot, _fp8.row_bytes(dd)) if fp8 else None,
                           local=local))
        return out

    # ------------------------------------------------------------------------------ run
    def run(self, q, k, v, rope, joint=None, key_mask=None):
        """One forward: ``[B, S_r, Hq, Dv]``, a new tensor; with joint rows (``joint=(q_j, k_j,
        v_j)``, required when the plan has them) ``(out, joint_out [B, S_j, Hq, Dv])``;
        ``key_mask``: bool ``[B, rows]`` of the rows attention runs over, for ``attn_fn``. Group
        g+1's fill and exchange are enqueued before group g's attention; each group's output
        reaches the final tensor through the transport (a copy out of its staging or receive
        buffer, docs/DESIGN.md), except with one rank: with one head group ``attn_fn``'s
        output is the result when it is a contiguous tensor of the result's shape and dtype;
        with several, nothing packed and no KV head shared by two groups, the outputs are
        concatenated (``_run_local``).
        Pipelined and sequential runs give the same bits.

        Streams of a run with G = 2 head groups: ``fill``: norm + RoPE + pack of a group's
        send buffer; ``in``/``out``: its input and output exchanges, on the transport's copy
        streams (``ce``) or NCCL's (``all_to_all``), from their start (``=``) to the wait the
        caller's stream makes for them (``^`` under ``|``); ``attn``: ``attn_fn``; time runs
        right::

            caller fill0 fill1 | attn0 | attn1 | | -> out
            in0         =======^
            in1               =========^
            out0                      =========^
            out1                              ===^

        Group 1's fill and input exchange run while group 0's input is in flight and under its
        attention. Sequential (G = 1) is ``fill0 | attn0 | -> out``, nothing to overlap.
        At most two output exchanges are in flight (the ``ce`` staging has two slots)."""
        rows = None if rope is None else self._rows(rope)
        if not self.fuse:  # norm/rope as their own pass over the local shard
            q, k = self._norm_rope(q, k, rows)
            rows = None
        if not self.fuse or self.all_local:
            # what the transports pack from, or, with nothing packed, what attn_fn reads: rows
            # of heads × D as in a receive buffer (SDPA's kernel and bits can change with a
            # strided D; fused and unfused runs must give the same bits)
            q, k, v = dense(q), dense(k), dense(v)
        qkv = (q, k, v)
        if self.local_splits is not None:
            return self._run_local(qkv, key_mask)
        dev = q.device
        out = flat = None
        if not self.alone:
            out = torch.empty(self.out_shape, dtype=q.dtype, device=dev)
            flat = out.view(-1)
        stores = [torch.empty(n, dtype=dt, device=dev) for dt, n in self.stores]
        groups, n = self.groups, self.n_groups
        joint_parts = []
        pending = []
        ex_in = self._start_in(groups[0], qkv, rows, stores, joint, dev)
        for g in range(n):
            # group g+1's fill and exchange first: the fill runs while group g's data is in
            # flight, its exchange under group g's attention
            nxt = (self._start_in(groups[g + 1], qkv, rows, stores, joint, dev) if g + 1 < n
                   else None)
            grp = groups[g]
            o = self._attend(grp, *self._arrived(grp, ex_in), key_mask)
            for ex, _, _ in ex_in:
                if ex is not None:
                    ex.release()
            if out is None:  # one rank, one head group: the output exchange is the identity
                if o.dtype == q.dtype and o.shape == self.out_shape and o.is_contiguous():
                    return o
                out = torch.empty(self.out_shape, dtype=q.dtype, device=dev)
                flat = out.view(-1)
            if self.joint:
                o, oj = self._split(o)
                joint_parts.append(oj)
            pending.append(grp.out_transport.start(grp.out_plan, [o], o.dtype, dev, out=flat))
            if len(pending) > 1:  # at most two output exchanges in flight (two slots)
                done = pending.pop(0)
                done.wait()
                done.release()
            ex_in = nxt
        joint_out = self._gather_joint(joint_parts, q) if self.joint else None
        for ex in pending:
            ex.wait()
            ex.release()
        return out if joint_out is None else (out, joint_out)

    def _run_local(self, qkv, key_mask):
        """``run`` with one rank, nothing packed and G head groups (``local_splits``): there is
        no exchange to overlap, so each part is split once into the groups' heads, ``attn_fn``
        runs on each group in turn and their outputs are concatenated once: the same
        ``attn_fn`` calls, and copies of their outputs, as the general path's."""
        slices = [x.split_with_sizes(n, 2) for x, n in zip(qkv, self.local_splits)]
        outs = [self._attend(grp, *(sl[g] for sl in slices), key_mask)
                for g, grp in enumerate(self.groups)]
        dt = qkv[0].dtype
        return torch.cat([o if o.dtype == dt else o.to(dt) for o in outs], 2)

    def _rows(self, rope):
        """cos/sin rows of this rank's positions: views made on every call. A plan keeps no
        reference to a caller's tensor past the call (inductor's CUDA graphs refuse a graph
        whose inputs, copied into their pool, stay alive after it). ``rope``: ``(cos, sin)``."""
        cos, sin = rope
        lo, hi = self.off, self.off + self.s_r
        if lo == 0 and hi == cos.shape[0] == sin.shape[0]:
            return cos, sin
        return cos[lo:hi], sin[lo:hi]

    def _norm_rope(self, q, k, rows):
        """RMSNorm + RoPE of q and k (``rows``: cos/sin for their sequence positions)."""
        if self.qk_norm is None and rows is None:
            return q, k
        qw, kw = (self.qk_norm[0], self.qk_norm[1]) if self.qk_norm is not None else (None, None)
        cs, sn = rows if rows is not None else (None, None)
        return (rms_norm_rope(q, qw, self.eps, cs, sn), rms_norm_rope(k, kw, self.eps, cs, sn))

    def _start_in(self, grp: _Group, qkv, rows, stores, joint, dev) -> list:
        """Start the input exchanges of one head group: ``[(exchange, landing buffer or None,
        received buffer)]``. With a fill, the fill packs each exchange's send buffer (norm +
        RoPE on the way when fused, FP8 rows for that payload) and the transport sends it as
        it is; otherwise the transport packs from q, k, v. With a landing buffer, the exchange
        of plain rows receives into its rows and the joint rows' heads are copied in. An
        exchange that moves nothing (``_In.direct``) is not started: its exchange is None and
        the filled storage its received buffer. One with nothing to pack (``_In.local``) gives
        ``(None, None, its parts' head slices of q, k, v)``."""
        exs = []
        cos, sin = rows if rows is not None else (None, None)
        for e in grp.ins:
            if e.local:
                exs.append((None, None, [_heads(qkv[i], lo, hi)
                                         for i, (lo, hi) in zip(e.parts, e.heads)]))
                continue
            t = e.transport
            xs = [qkv[i] for i in e.parts]
            land = into = None
            if e.land is not None:
                land = torch.empty(e.land, dtype=e.src_dtype, device=dev)
                if e.wire is None:  # plain rows: received in place
                    into = self._seq_rows(land).view(-1)
            if e.fill is not None:
                mem = None
                if e.store is not None:
                    i, part = e.store
                    mem = stores[i] if part is None else stores[i][part]
                if e.direct:
                    e.fill(xs, cos, sin, mem)
                    ex, got = None, mem
                else:
                    send = t.send_buffer(e.plan, e.dtype, dev, mem)
                    e.fill(xs, cos, sin, send.flat if send.flat is not None else send.regions)
                    ex, got = t.start(e.plan, (), e.dtype, dev, into, send=send), None
            else:
                ex, got = t.start(e.plan, xs, e.dtype, dev, into), None
            if joint is not None and self.s_j:
                self._put_joint(e, land, joint)
            exs.append((ex, land, got))
        return exs

    def _seq_rows(self, land):
        """The exchanged rows of a landing buffer ``[S_j + S, B, htot, D]``."""
        return land[self.s_j:] if self.front else land[:self.s_total]

    def _put_joint(self, e: _In, land, joint) -> None:
        """This rank's heads of the joint rows into the landing buffer's joint rows."""
        rows = land[:self.s_j] if self.front else land[self.s_total:]
        col = 0
        for i, (lo, hi) in zip(e.parts, e.heads):
            if hi > lo:
                rows[:, :, col:col + hi - lo].copy_(joint[i][:, :, lo:hi].transpose(0, 1))
                col += hi - lo

    def _arrived(self, grp: _Group, flights) -> list:
        """Wait for a group's input exchanges: ``[q, k, v]`` views ``[B, rows, h, D]`` of the
        receive buffers (or landing buffers; FP8 rows dequantized into theirs first)."""
        views = [None, None, None]
        for e, (ex, land, buf) in zip(grp.ins, flights):
            if e.local:  # the parts' own heads (``_start_in``)
                for i, x in zip(e.parts, buf):
                    views[i] = x
                continue
            if ex is not None:
                buf = ex.wait()
            if e.wire is not None:
                _fp8.dequantize_packed(buf.view(e.wire), e.src_dtype, out=self._seq_rows(land))
            if land is not None:
                buf = land
            size, stride = e.view
            buf = buf.as_strided(size, stride, buf.storage_offset())
            if e.splits is None:
                views[e.parts[0]] = buf
            else:  # one call for the parts' views (cheaper on the host than one each)
                for i, x in zip(e.parts, buf.split_with_sizes(e.splits, 2)):
                    views[i] = x
        return views

    def _attend(self, grp: _Group, qg, kg, vg, key_mask=None):
        """``attn_fn`` on this rank's heads of one group (``[B, rows, h, Dv]``), with the KV heads
        expanded to one per query head when the rank's grouping is not uniform."""
        if grp.heads == 0 or self.rows == 0:
            return qg.new_empty(qg.shape[0], self.rows, grp.heads, self.dv)
        if grp.idx is not None:
            kg, vg = kg.index_select(2, grp.idx), vg.index_select(2, grp.idx)
        if key_mask is None:
            return dense(self.attn_fn(qg, kg, vg, self.causal))
        return dense(self.attn_fn(qg, kg, vg, self.causal, key_padding_mask=key_mask))

    def _split(self, o):
        """A group's attention output over the concatenation → (the sequence rows, the joint
        rows)."""
        if self.front:
            return o[:, self.s_j:], o[:, :self.s_j]
        return o[:, :self.s_total], o[:, self.s_total:]

    def _gather_joint(self, parts, q):
        """The joint rows' output with every head on every rank, ``[B, S_j, Hq, Dv]``: this
        rank's groups' parts side by side (``[B, S_j, h_r, Dv]``), gathered over heads."""
        res = torch.empty(self.joint_shape, dtype=q.dtype, device=q.device)
        if self.joint_plan is None:  # S_j == 0
            return res
        if len(parts) == 1:
            src = parts[0]
        else:
            src = torch.empty(self.joint_shape[0], self.s_j, self.h_r, self.dv, dtype=q.dtype,
                              device=q.device)
            col = 0
            for p in parts:
                src[:, :, col:col + p.shape[2]].copy_(p)
                col += p.shape[2]
        ex = self.joint_transport.start(self.joint_plan, [src], q.dtype, q.device,
                                        out=res.view(-1))
        ex.wait()
        ex.release()
        return res
