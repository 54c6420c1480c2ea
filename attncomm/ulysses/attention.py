"""``UlyssesAttention``: sequence-sharded q/k/v → head-sharded attention over the whole sequence →
sequence-sharded output, with GQA/MQA, optional RMSNorm + RoPE and head-group pipelining."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import _dist, config
from .._dist import cpu_group, group_key
from .api import (_BACKEND_CODES, _norm_seq_lens, _seq_lens_error, check_call, dense, get_transport,
                  resolve_backend, seq_lens_hash)
from .layout import (group_head_ranges, head_offsets, head_to_seq_plan, kv_head_range,
                     seq_to_head_plan, uniform_group)

__all__ = ["UlyssesAttention", "sdpa_attention", "rms_norm_rope"]


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


def _tree_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in a fixed pairwise order (same bits for any layout/device)."""
    n = t.shape[-1]
    while n > 1:
        half = n // 2
        head = t[..., :half] + t[..., half:2 * half]
        t = torch.cat((head, t[..., 2 * half:]), dim=-1) if n % 2 else head
        n = half + n % 2
    return t


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                  cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
    """RMSNorm over ``D`` then rotate-half (NeoX) RoPE, in fp32, rounded once to ``x.dtype``.

    Arguments:
        x: ``[B, S, H, D]`` (any strides).
        weight: ``[D]`` RMSNorm weight or None (no norm); ``eps`` its epsilon.
        cos, sin: ``[S, D]`` for the positions of ``x``'s sequence axis, or None (no RoPE).

    Returns ``[B, S, H, D]`` contiguous. Elementwise ops and a fixed-order sum only, so the bits
    do not depend on the layout: applied before or after the all-to-all (unfused / fused) they
    agree exactly.
    """
    xf = x.to(torch.float32).contiguous()
    d = xf.shape[-1]
    if weight is not None:
        ms = _tree_sum(xf * xf) / d
        xf = xf * torch.rsqrt(ms + eps) * weight.to(torch.float32)
    if cos is not None:
        c = cos.to(torch.float32)[:, None, :]
        s = sin.to(torch.float32)[:, None, :]
        half = d // 2
        rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        xf = xf * c + rot * s
    return xf.to(x.dtype)


class UlyssesAttention(torch.nn.Module):
    """Attention over the whole sequence on sequence-sharded inputs (DeepSpeed-Ulysses).

    Arguments:
        attn_fn: ``attn_fn(q [B, S, h, D], k [B, S, g, D], v [B, S, g, Dv], causal) →
            [B, S, h, Dv]`` with ``h % g == 0`` and query head i using KV head ``i // (h/g)``
            (default: ``sdpa_attention``).
        group: process group (None: default).
        backend: ``"all_to_all"``, ``"ce"`` or ``"auto"`` (env ``ATTNCOMM_ULYSSES_BACKEND``).
        pipeline_groups: −1 automatic (env ``ATTNCOMM_ULYSSES_PIPELINE_GROUPS``; today
            sequential, from measurement: see ``_pipeline_groups``), 0 sequential, N ≥ 2 forces N
            head groups (group g+1's exchange issued before group g's attention).
        qk_norm: ``(q_weight [D], k_weight [D], eps)`` RMSNorm for q and k, or None.
        timeout_s: wait budget (None: ``ATTNCOMM_TIMEOUT_S``).
        fuse_qk_norm_rope: apply norm/RoPE to the received head-sharded data (True) or to the
            local shard before the exchange (False); the results are bitwise equal.
        validate: cross-rank argument check (None: env, default on outside graph capture).

    ``forward(q [B, S_r, Hq, D], k [B, S_r, Hkv, D], v [B, S_r, Hkv, Dv], *, seq_lens=None,
    causal=False, rope=None) → [B, S_r, Hq, Dv]``; ``rope=(cos, sin)`` each ``[S, D]`` over
    global positions. Query head h attends with KV head ``h // (Hq / Hkv)``; each rank receives
    the KV heads its query heads use and expands them locally when its grouping is not
    uniform.

    Attributes:
        fallback_reason: why the last ``forward`` with ``backend="auto"`` did not take ``ce``
            for some exchange (None when every exchange that could use ``ce`` did, or the
            message was small enough for ``all_to_all`` to be the choice). Per module; the
            process-global ``attncomm.ulysses.fallback_reason`` holds the last decision of any
            caller in the process and is kept for compatibility.
        last_backends: the transports the last ``forward`` used, e.g.
            ``{"in": "ce", "out": "ce"}``.

    Raises:
        ValueError (every rank): not 4-D tensors, ``Hq % Hkv != 0``, mismatched shapes across
        tensors or ranks, bad ``seq_lens``/``rope``/``qk_norm``/``pipeline_groups`` (also from
        env ``ATTNCOMM_ULYSSES_PIPELINE_GROUPS``); PeerTimeoutError when a peer does not answer.
    """

    def __init__(self, attn_fn=None, group=None, *, backend: str = "auto",
                 pipeline_groups: int = -1, qk_norm=None, timeout_s: float | None = None,
                 fuse_qk_norm_rope: bool = True, validate: bool | None = None):
        super().__init__()
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
        raw = os.environ.get("ATTNCOMM_ULYSSES_PIPELINE_GROUPS", "").strip()
        if g != -1 or not raw:
            return g, None
        try:
            val = int(raw)
        except ValueError:
            return -1, f"ATTNCOMM_ULYSSES_PIPELINE_GROUPS={raw!r} is not an int"
        why = _pipeline_groups_error(val)
        return (-1, f"ATTNCOMM_ULYSSES_PIPELINE_GROUPS={raw!r}: {why}") if why else (val, None)

    def _pipeline_groups(self, g, device) -> int:
        """Head groups for this forward: ``g`` (requested, checked) resolved; 1 = sequential.

        ``-1`` (automatic) is sequential: measured on 2× H200 for a DiT layer (S=32768, 24
        heads, D=128, bf16; ``benchmarks/results/ulysses-layer-2026-11-30-nvidia-h200-x2.md``),
        4 head groups hid none of the exchange (all_to_all 0.998×, ce 0.90× of the sequential
        forward), so automatic stays sequential until a pipelined schedule is shown to pay.
        ``N ≥ 2`` forces N groups, on CUDA only when every rank has room for the groups' working
        sets (agreed: every rank has ≥ 1/4 of its memory free), else sequential everywhere.
        """
        if g in (-1, 0):
            return 1
        if device.type == "cuda" and not _agree_fits(self.group, device):
            return 1
        return g

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
        check_call(group, "UlyssesAttention", validate, sig, labels, error, timeout)
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
        """Head group g's exchange overlaps group g−1's attention; each group's output goes
        straight into the final tensor. Pipelined and sequential runs give the same bits."""
        b, hq, hkv, d, dv = dims
        group = self.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        s_total, m = sum(seq), hq // hkv
        n_groups = self._pipeline_groups(groups, q.device)
        self.last_pipeline_groups = n_groups
        qranges = group_head_ranges(hq, world, n_groups)
        fused = self.fuse_qk_norm_rope
        if not fused:  # norm/rope on the local shard, before the exchange
            off = head_offsets(seq)[rank]
            q, k = self._norm_rope(q, k, rope, None if rope is None else
                                   (rope[0][off:off + seq[rank]], rope[1][off:off + seq[rank]]))
        q, k, v = dense(q), dense(k), dense(v)
        out = torch.empty(b, seq[rank], hq, dv, dtype=q.dtype, device=q.device)
        ctx = dict(group=group, backend=backend, timeout=timeout, seq=seq, b=b, m=m)
        pending_out = []
        ex_in = self._start_in(ctx, q, k, v, qranges[0])
        for g in range(n_groups):
            bufs = [(e, e.wait()) for e in ex_in[1]]
            qg, kg, vg = self._views(ctx, ex_in[0], bufs)
            q_lo, q_hi = qranges[g][rank]
            if fused and q_hi > q_lo:
                qg, kg = self._norm_rope(qg, kg, rope, rope)
            nxt = self._start_in(ctx, q, k, v, qranges[g + 1]) if g + 1 < n_groups else None
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
            kv_lo = kv_head_range(q_lo, q_hi, m)[0]
            idx = torch.tensor([h // m - kv_lo for h in range(q_lo, q_hi)], device=kg.device)
            kg, vg = kg.index_select(2, idx), vg.index_select(2, idx)
        return dense(self.attn_fn(qg, kg, vg, causal))

    def _start_in(self, ctx, q, k, v, qr):
        """Start the exchanges of one head group: q, k, v in one exchange when their dtype and
        head_dim agree (else one per (dtype, D))."""
        kvr = tuple(kv_head_range(lo, hi, ctx["m"]) for lo, hi in qr)
        qr = tuple(qr)
        keyed: dict = {}
        for name, t, ranges in (("q", q, qr), ("k", k, kvr), ("v", v, kvr)):
            keyed.setdefault((t.dtype, t.shape[3]), []).append((name, t, ranges))
        layout, exs = [], []
        for (dtype, dd), items in keyed.items():
            plan = seq_to_head_plan(ctx["b"], ctx["seq"], dd, tuple(r for _, _, r in items))
            t = get_transport(ctx["group"], ctx["backend"], q.device, ctx["timeout"], plan,
                              dtype, "UlyssesAttention", owner=self)
            self.last_backends["in"] = t.name
            exs.append(t.start(plan, [x for _, x, _ in items], dtype, q.device))
            layout.append(([(name, r) for name, _, r in items], dd))
        self.last_in_exchanges = len(exs)
        return layout, exs

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
    if isinstance(g, bool) or not isinstance(g, int) or g < -1 or g == 1:
        return "must be -1 (auto), 0 (sequential) or N ≥ 2 (head groups)"
    return None


#: ``group_key(group) → bool``, keyed by the group object (never ``id``, which can be reused).
_FITS: dict = {}


def _agree_fits(group, device) -> bool:
    """Whether every rank has at least 1/4 of its memory free (agreed; cached per group)."""
    key = group_key(group)
    if key not in _FITS:
        free, total = torch.cuda.mem_get_info(device)
        flag = torch.tensor([1 if free * 4 >= total else 0], dtype=torch.int64)
        g = cpu_group(group)
        if dist.get_world_size(g) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=g)
        _FITS[key] = bool(flag.item())
    return _FITS[key]
