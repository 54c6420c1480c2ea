"""``UlyssesAttention``: sequence-sharded q/k/v → head-sharded attention over the whole sequence →
sequence-sharded output, with GQA/MQA, optional RMSNorm + RoPE and head-group pipelining.

Schedule of a forward with G head groups (one stream; the exchanges run on the transport's
streams or copy engines)::

    fill(0) send(0) | fill(1) send(1) wait(0) attend(0) out(0) | fill(2) send(2) wait(1) ...

Group g+1's fill (norm + RoPE + pack, ``ulysses/fill.py``) and exchange are enqueued before
group g's wait and attention, so the fill runs while group g's data is in flight and the
exchange under group g's attention; this module only enqueues (no event polling, ``.item()``
or synchronize in it), so the host can run ahead of the GPU.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import _dist, config
from .._dist import cpu_group, group_key
from .api import (_BACKEND_CODES, _norm_seq_lens, _seq_lens_error, check_call, dense, get_transport,
                  resolve_backend, seq_lens_hash)
from .fill import FillPart, fill, rms_norm_rope
from .layout import (group_head_ranges, head_offsets, head_split, head_to_seq_plan, kv_head_range,
                     seq_to_head_plan, uniform_group)

__all__ = ["UlyssesAttention", "sdpa_attention", "rms_norm_rope", "auto_groups",
           "AUTO_PIPELINE", "MAX_GROUPS", "MIN_WAVES"]

#: Whether ``pipeline_groups=-1`` pipelines (with ``auto_groups``'s count) or runs sequentially.
#: Off until a two-GPU timeline shows head groups winning over the sequential forward: the
#: one-GPU rehearsal (scripts/ulysses_one_gpu.py) shows the schedule's overlap, not NVLink's.
AUTO_PIPELINE = False
#: ``auto_groups`` bounds: at most this many groups (each adds launches and flag waits)...
MAX_GROUPS = 8
#: ... and each group's attention at least this many waves of 128-row query blocks over the
#: SMs (a group's last, partial wave leaves SMs idle; G groups pay that tail G times).
MIN_WAVES = 1.5
_BLOCK_M = 128


def auto_groups(heads_per_rank, batch: int, seq_total: int, sm_count: int,
                max_groups: int = MAX_GROUPS, min_waves: float = MIN_WAVES) -> int:
    """The head-group count ``pipeline_groups=-1`` uses when it pipelines: the largest
    ``G ≤ max_groups`` that splits every rank's query heads evenly (``heads_per_rank``, e.g.
    ``head_split(Hq, W)``) and keeps each group's attention ``≥ min_waves`` waves deep
    (``batch · h_r/G · ⌈S/128⌉ ≥ min_waves · sm_count`` on the rank with the fewest heads);
    1 when none does. 56 heads at W = 2, 4, 8 and S = 32768 on 132 SMs → 7 (SGLang's choice
    for MiniMax-H3)."""
    busy = [h for h in heads_per_rank if h > 0]
    if not busy or sm_count < 1:
        return 1
    blocks = batch * math.ceil(seq_total / _BLOCK_M)
    for g in range(min(max_groups, min(busy)), 1, -1):
        if all(h % g == 0 for h in busy) and blocks * (min(busy) // g) >= min_waves * sm_count:
            return g
    return 1


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   causal: bool) -> torch.Tensor:
    """The default ``attn_fn``: PyTorch SDPA, scale ``1/√D``.

    ``q [B, S, h, D]``, ``k [B, S, g, D]``, ``v [B, S, g, Dv]`` with ``h % g == 0`` (query head i
    uses KV head ``i // (h / g)``) → ``[B, S, h, Dv]``."""
    h, g = q.shape[2], k.shape[2]
    # SDPA picks its kernel (and blocking) by shape, so a head's bits can depend on how many
    # heads share the call. On CPU run one head per call (bits independent of the grouping, so
    # pipelined runs equal sequential ones); on CUDA one call per group (flash attention
    # computes each head on its own unless it splits the KV sequence).
    if g != h:
        k = k.repeat_interleave(h // g, dim=2)
        v = v.repeat_interleave(h // g, dim=2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if q.device.type == "cpu":
        if h == 0:
            return q.new_empty(q.shape[0], q.shape[1], 0, v.shape[3])
        outs = [sdpa(q[:, :, i:i + 1].transpose(1, 2).contiguous(),
                     k[:, :, i:i + 1].transpose(1, 2).contiguous(),
                     v[:, :, i:i + 1].transpose(1, 2).contiguous(), is_causal=causal)
                for i in range(h)]
        return torch.cat(outs, dim=1).transpose(1, 2)
    out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


class UlyssesAttention(torch.nn.Module):
    """Attention over the whole sequence on sequence-sharded inputs (DeepSpeed-Ulysses).

    Arguments:
        attn_fn: ``attn_fn(q [B, S, h, D], k [B, S, g, D], v [B, S, g, Dv], causal) →
            [B, S, h, Dv]`` with ``h % g == 0`` and query head i using KV head ``i // (h/g)``
            (default: ``sdpa_attention``).
        group: process group (None: default).
        backend: ``"all_to_all"``, ``"ce"`` or ``"auto"`` (env ``ATTNCOMM_ULYSSES_BACKEND``).
        pipeline_groups: −1 automatic (env ``ATTNCOMM_ULYSSES_PIPELINE_GROUPS``): sequential
            while ``AUTO_PIPELINE`` is off (no two-GPU measurement has shown head groups to
            win yet), else ``auto_groups``'s count; 0 or 1 (one head group) sequential; N ≥ 2
            forces N head groups (group g+1's fill and exchange issued before group g's
            attention). Any G ≥ 2 runs only when every rank has room for two groups' working
            sets (agreed before any allocation), else every rank runs sequentially.
        qk_norm: ``(q_weight [D], k_weight [D], eps)`` RMSNorm for q and k, or None.
        timeout_s: wait budget (None: ``ATTNCOMM_TIMEOUT_S``).
        fuse_qk_norm_rope: norm + RoPE inside the fill that packs the send buffer (True: one
            pass over q, k, v) or as their own pass over the local shard before the transport
            packs (False); the results are bitwise equal.
        fill_impl: the fill's implementation: ``"auto"`` (the Triton kernel for CUDA tensors
            with a power-of-two head_dim, else torch ops), ``"triton"`` or ``"torch"``; the
            same bits either way.
        validate: cross-rank argument check (None: env, default on outside graph capture).

    ``forward(q [B, S_r, Hq, D], k [B, S_r, Hkv, D], v [B, S_r, Hkv, Dv], *, seq_lens=None,
    causal=False, rope=None) → [B, S_r, Hq, Dv]``; ``rope=(cos, sin)`` each ``[S, D]`` over
    global positions. Query head h attends with KV head ``h // (Hq / Hkv)``; each rank receives
    the KV heads its query heads use and expands them locally when its grouping is not
    uniform.

    Attributes:
        fallback_reason: why the last ``forward`` with ``backend="auto"`` did not take ``ce``
            for some exchange (None when every exchange that could use ``ce`` did, or the
            message was small enough for ``all_to_all`` to be the choice).
        last_backends: the transports the last ``forward`` used, e.g.
            ``{"in": "ce", "out": "ce"}``.

    Raises:
        ValueError (every rank): not 4-D tensors, ``Hq % Hkv != 0``, mismatched shapes across
        tensors or ranks, bad ``seq_lens``/``rope``/``qk_norm``/``pipeline_groups`` (also from
        env ``ATTNCOMM_ULYSSES_PIPELINE_GROUPS``); PeerTimeoutError when a peer does not answer.
    """

    def __init__(self, attn_fn=None, group=None, *, backend: str = "auto",
                 pipeline_groups: int = -1, qk_norm=None, timeout_s: float | None = None,
                 fuse_qk_norm_rope: bool = True, validate: bool | None = None,
                 fill_impl: str = "auto"):
        super().__init__()
        if fill_impl not in ("auto", "triton", "torch"):
            raise ValueError(f"fill_impl must be 'auto', 'triton' or 'torch', got {fill_impl!r}")
        why = _pipeline_groups_error(pipeline_groups)
        if why:
            raise ValueError(f"pipeline_groups {why}, got {pipeline_groups!r}")
        if backend not in ("all_to_all", "ce", "auto"):
            raise ValueError(f"backend must be 'all_to_all', 'ce' or 'auto', got {backend!r}")
        if qk_norm is not None:
            if len(qk_norm) != 3 or not float(qk_norm[2]) > 0:
                raise ValueError("qk_norm must be (q_weight [D], k_weight [D], eps > 0)")
        self.attn_fn = attn_fn or sdpa_attention
        self.group = group
        self.backend = backend
        self.pipeline_groups = pipeline_groups
        self.qk_norm = qk_norm
        self.timeout_s = timeout_s
        self.fuse_qk_norm_rope = fuse_qk_norm_rope
        self.fill_impl = fill_impl
        self._idx: dict = {}  # (device, q_lo, q_hi, m) → KV head index for non-uniform groups
        self.validate = validate
        #: The transports the last forward used, e.g. ``{"in": "ce", "out": "ce"}``.
        self.last_backends: dict = {}
        #: Head groups and input exchanges per group of the last forward (1 when q, k, v share
        #: dtype and head_dim and so travel together).
        self.last_pipeline_groups = 0
        self.last_in_exchanges = 0
        #: Why the last ``auto`` forward did not take ``ce`` (see the class docstring).
        self.fallback_reason: str | None = None

    # ----------------------------------------------------------------------------- checks
    def _check(self, q, k, v, seq, rope, error):
        """Local checks (no communication): ``(error or None, (B, S_r, Hq, Hkv, D, Dv), seq)``,
        the dims all 0 when q/k/v are not 4-D tensors."""
        group = self.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
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
        if error is None and self.qk_norm is not None:
            qw, kw, _ = self.qk_norm
            if tuple(qw.shape) != (d,) or tuple(kw.shape) != (d,):
                error = (f"qk_norm weights must be [D] = [{d}], got {list(qw.shape)} and "
                         f"{list(kw.shape)}")
        if error is None and rope is not None:
            want = (sum(seq), d)
            try:
                cos, sin = rope
                shapes = (tuple(cos.shape), tuple(sin.shape))
            except (TypeError, ValueError, AttributeError):
                return (f"rope must be (cos, sin) tensors [S, D] = {list(want)}, got "
                        f"{type(rope).__name__}"), (b, s_r, hq, hkv, d, dv), seq
            if shapes != (want, want):
                error = (f"rope cos/sin must be [S, D] = {list(want)}, got {list(cos.shape)} "
                         f"and {list(sin.shape)}")
            elif d % 2:
                error = f"rope needs an even head_dim, got D = {d}"
        return error, (b, s_r, hq, hkv, d, dv), seq

    def _requested_groups(self) -> tuple[int, str | None]:
        """``pipeline_groups`` with env ``ATTNCOMM_ULYSSES_PIPELINE_GROUPS`` applied to −1, and
        the error (or None) for a bad env value."""
        g = self.pipeline_groups
        raw = config.raw("ATTNCOMM_ULYSSES_PIPELINE_GROUPS")
        if g != -1 or not raw:
            return g, None
        try:
            val = int(raw)
        except ValueError:
            return -1, f"ATTNCOMM_ULYSSES_PIPELINE_GROUPS={raw!r} is not an int"
        why = _pipeline_groups_error(val)
        return (-1, f"ATTNCOMM_ULYSSES_PIPELINE_GROUPS={raw!r}: {why}") if why else (val, None)

    def _pipeline_groups(self, g, device, dims, seq) -> int:
        """Head groups for this forward (1 = sequential) from the requested ``g`` (checked and
        agreed): −1 → ``auto_groups`` when ``AUTO_PIPELINE`` is on, else 1; N ≥ 2 → N if every
        rank has room for two groups' working sets (``_agree_fits``, before any allocation)."""
        b, hq, hkv, d, dv = dims
        world = dist.get_world_size(self.group)
        if g == -1:
            g = 1
            if AUTO_PIPELINE and device.type == "cuda":
                sms = torch.cuda.get_device_properties(device).multi_processor_count
                g = auto_groups(head_split(hq, world), b, sum(seq), sms)
        if g < 2:
            return 1
        rank = dist.get_rank(self.group)
        h_r = head_split(hq, world)[rank]
        item = 4  # an upper bound for fp16/bf16/fp32
        work = b * (seq[rank] * (hq + 2 * hkv) * d          # fill send buffer
                    + sum(seq) * (h_r + 2 * hkv) * d        # receive buffer (≤ all KV heads)
                    + sum(seq) * h_r * dv) * item           # attention output
        key = (dims, tuple(seq), g)
        return g if _agree_fits(self.group, device, key, 2 * -(-work // g)) else 1

    # ----------------------------------------------------------------------------- forward
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq_lens=None,
                causal: bool = False, rope=None) -> torch.Tensor:
        group = self.group
        timeout = config.timeout_s(self.timeout_s)
        error = None
        try:
            backend = resolve_backend(self.backend)
        except ValueError as exc:
            backend, error = "auto", str(exc)
        groups, g_err = self._requested_groups()
        error = error or g_err
        try:
            seq_in = _norm_seq_lens(seq_lens)
        except TypeError:
            seq_in, error = None, error or f"seq_lens must be a sequence of ints, got {seq_lens!r}"
        error, (b, s_r, hq, hkv, d, dv), seq = self._check(q, k, v, seq_in, rope, error)
        ok = error is None
        codes = [_dist.DTYPE_CODES.get(t.dtype, 0) if isinstance(t, torch.Tensor) else 0
                 for t in (q, k, v)]
        sig = [b, hq, hkv, d, dv, *codes, int(bool(q.is_cuda)) if ok else -1,
               _BACKEND_CODES[backend], int(bool(causal)), int(rope is not None),
               int(self.qk_norm is not None), s_r if seq_in is None else -1,
               sum(seq) if ok else -1, seq_lens_hash(seq) if ok else -1, groups]
        labels = ["B", "Hq", "Hkv", "D", "Dv", "q dtype", "k dtype", "v dtype", "CUDA",
                  "backend", "causal", "rope given", "qk_norm given", "S_r (seq_lens=None)",
                  "sum(seq_lens)", "seq_lens (hash)", "pipeline_groups"]
        capturing = (isinstance(q, torch.Tensor) and q.is_cuda
                     and torch.cuda.is_current_stream_capturing())
        validate = config.validate_enabled(self.validate, default=not capturing)
        check_call(group, "UlyssesAttention", validate, sig, labels, error, timeout,
                   seq_lens=seq)
        self.fallback_reason = None
        return self._run(q, k, v, seq, causal, rope, backend, timeout, groups,
                         (b, hq, hkv, d, dv))

    def _norm_rope(self, q, k, rope, cos_sin):
        """RMSNorm + RoPE of q and k (``cos_sin`` rows for their sequence positions)."""
        if self.qk_norm is None and rope is None:
            return q, k
        qw, kw, eps = self.qk_norm if self.qk_norm is not None else (None, None, 0.0)
        cs, sn = cos_sin if rope is not None else (None, None)
        return (rms_norm_rope(q, qw, float(eps), cs, sn),
                rms_norm_rope(k, kw, float(eps), cs, sn))

    def _run(self, q, k, v, seq, causal, rope, backend, timeout, groups, dims):
        """Group g+1's fill and exchange are enqueued before group g's attention; each group's
        output reaches the final tensor through the transport (a copy out of its staging or
        receive buffer, docs/DESIGN.md). Pipelined and sequential runs give the same bits.
        Nothing here waits for the GPU on the host."""
        b, hq, hkv, d, dv = dims
        group = self.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        s_total, m = sum(seq), hq // hkv
        n_groups = self._pipeline_groups(groups, q.device, dims, seq)
        self.last_pipeline_groups = n_groups
        qranges = group_head_ranges(hq, world, n_groups)
        off = head_offsets(seq)[rank]
        rows = None if rope is None else (rope[0][off:off + seq[rank]],
                                          rope[1][off:off + seq[rank]])
        if not self.fuse_qk_norm_rope:  # norm/rope as their own pass over the local shard
            q, k = self._norm_rope(q, k, rope, rows)
            q, k, v = dense(q), dense(k), dense(v)
        out = torch.empty(b, seq[rank], hq, dv, dtype=q.dtype, device=q.device)
        ctx = dict(group=group, backend=backend, timeout=timeout, seq=seq, b=b, m=m,
                   rows=rows)
        pending_out = []
        ex_in = self._start_in(ctx, q, k, v, qranges[0])
        for g in range(n_groups):
            # group g+1's fill and exchange first: the fill runs while group g's data is in
            # flight, its exchange under group g's attention
            nxt = self._start_in(ctx, q, k, v, qranges[g + 1]) if g + 1 < n_groups else None
            bufs = [(e, e.wait()) for e in ex_in[1]]
            qg, kg, vg = self._views(ctx, ex_in[0], bufs)
            q_lo, q_hi = qranges[g][rank]
            og = self._attend(qg, kg, vg, q_lo, q_hi, m, causal, s_total, dv)
            for e, _ in bufs:
                e.release()
            pending_out.append(self._start_out(ctx, og, qranges[g], hq, dv, out.view(-1)))
            if len(pending_out) > 1:  # at most two output exchanges in flight (two slots)
                done = pending_out.pop(0)
                done.wait()
                done.release()
            ex_in = nxt
        for e in pending_out:
            e.wait()
            e.release()
        return out

    def _attend(self, qg, kg, vg, q_lo, q_hi, m, causal, s_total, dv):
        """``attn_fn`` on this rank's heads ``[q_lo, q_hi)`` of one group, with the KV heads
        expanded to one per query head when the rank's grouping is not uniform."""
        if q_hi <= q_lo or s_total == 0:
            return qg.new_empty(qg.shape[0], s_total, q_hi - q_lo, dv)
        if not uniform_group(q_lo, q_hi, m):
            key = (kg.device, q_lo, q_hi, m)
            idx = self._idx.get(key)
            if idx is None:  # built once: a host → device copy per forward would block
                kv_lo = kv_head_range(q_lo, q_hi, m)[0]
                idx = torch.tensor([h // m - kv_lo for h in range(q_lo, q_hi)],
                                   device=kg.device)
                self._idx[key] = idx
            kg, vg = kg.index_select(2, idx), vg.index_select(2, idx)
        return dense(self.attn_fn(qg, kg, vg, causal))

    def _start_in(self, ctx, q, k, v, qr):
        """Start the exchanges of one head group: q, k, v in one exchange when their dtype and
        head_dim agree (else one per (dtype, D)). With ``fuse_qk_norm_rope`` the fill packs
        each exchange's send buffer (norm + RoPE on the way) and the transport sends it as
        it is; otherwise the transport packs from q, k, v."""
        kvr = tuple(kv_head_range(lo, hi, ctx["m"]) for lo, hi in qr)
        qr = tuple(qr)
        keyed: dict = {}
        for name, t, ranges in (("q", q, qr), ("k", k, kvr), ("v", v, kvr)):
            keyed.setdefault((t.dtype, t.shape[3]), []).append((name, t, ranges))
        layout, exs = [], []
        for (dtype, dd), items in keyed.items():
            ranges = tuple(r for _, _, r in items)
            plan = seq_to_head_plan(ctx["b"], ctx["seq"], dd, ranges)
            t = get_transport(ctx["group"], ctx["backend"], q.device, ctx["timeout"], plan,
                              dtype, "UlyssesAttention", owner=self)
            self.last_backends["in"] = t.name
            if self.fuse_qk_norm_rope:
                send = t.send_buffer(plan, dtype, q.device)
                self._fill(ctx, items, send)
                exs.append(t.start(plan, [], dtype, q.device, send=send))
            else:
                exs.append(t.start(plan, [x for _, x, _ in items], dtype, q.device))
            layout.append(([(name, r) for name, _, r in items], dd))
        self.last_in_exchanges = len(exs)
        return layout, exs

    def _fill(self, ctx, items, send):
        """Fill the transport's send buffer of one exchange (``ulysses/fill.py``): region p
        holds this rank's rows of p's heads, q and k normed and rotated on the way."""
        qw, kw, eps = self.qk_norm if self.qk_norm is not None else (None, None, 0.0)
        rows = ctx["rows"]
        weights = {"q": qw, "k": kw}
        parts = [FillPart(x, r, weights.get(name), rows is not None and name != "v")
                 for name, x, r in items]
        cos, sin = rows if rows is not None else (None, None)
        out = send.flat if send.flat is not None else send.regions
        fill(parts, float(eps), cos, sin, out=out, impl=self.fill_impl)

    def _views(self, ctx, layout, bufs):
        rank = dist.get_rank(ctx["group"])
        s_total, b = sum(ctx["seq"]), ctx["b"]
        views = {}
        for (items, dd), (_, buf) in zip(layout, bufs):
            htot = sum(r[rank][1] - r[rank][0] for _, r in items)
            full = buf.view(s_total, b, htot, dd)
            col = 0
            for name, r in items:
                n = r[rank][1] - r[rank][0]
                views[name] = full[:, :, col:col + n].permute(1, 0, 2, 3)
                col += n
        return views["q"], views["k"], views["v"]

    def _start_out(self, ctx, og, qr, hq, dv, flat_out):
        src_heads = tuple(hi - lo for lo, hi in qr)
        offs = tuple(lo for lo, _ in qr)
        plan = head_to_seq_plan(ctx["b"], ctx["seq"], dv, src_heads, offs, hq)
        t = get_transport(ctx["group"], ctx["backend"], og.device, ctx["timeout"], plan,
                          og.dtype, "UlyssesAttention", owner=self)
        self.last_backends["out"] = t.name
        return t.start(plan, [og], og.dtype, og.device, out=flat_out)


def _pipeline_groups_error(g) -> str | None:
    if isinstance(g, bool) or not isinstance(g, int) or g < -1:
        return "must be -1 (auto), 0 or 1 (sequential) or N ≥ 2 (head groups)"
    return None


#: ``(group_key(group), device type, call key) → bool``; keyed by the group object (never
#: ``id``, which can be reused) and a key every rank computes alike (the agreed call's shape).
_FITS: dict = {}


def _free_bytes(device) -> int | None:
    """Memory this rank can still allocate on ``device`` (free + cached by torch's allocator);
    None where there is no bound worth checking (CPU)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _agree_fits(group, device, key, need_bytes: int) -> bool:
    """Whether every rank has ``need_bytes`` to spare (its own need; agreed by all_reduce(MIN)
    over the gloo twin of ``group``, cached per call shape, so a later call does not ask)."""
    ck = (group_key(group), device.type, key)
    if ck not in _FITS:
        free = _free_bytes(device)
        flag = torch.tensor([1 if free is None or free >= need_bytes else 0], dtype=torch.int64)
        g = cpu_group(group)
        if dist.get_world_size(g) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=g)
        if len(_FITS) > 256:
            _FITS.clear()
        _FITS[ck] = bool(flag.item())
    return _FITS[ck]
