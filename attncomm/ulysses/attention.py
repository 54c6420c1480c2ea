"""``UlyssesAttention``: sequence-sharded q/k/v → head-sharded attention over the whole sequence →
sequence-sharded output, with GQA/MQA, optional RMSNorm + RoPE and head-group pipelining.

Hot path: the first forward with a new shape checks its arguments across ranks (first sight
per group, ``validate``), decides the head groups and every exchange's transport and builds a
``ForwardPlan`` (``ulysses/forward_plan.py``, which also has the schedule); a later forward with
that shape finds its plan by a key of its arguments and runs it. The plan is what a CUDA graph
of the forward records; under ``torch.compile`` the forward is one custom op
(``attncomm::ulysses_attention``, ``ulysses/ops.py``) that runs the plan an eager forward of
the shape made.
"""
from __future__ import annotations

import collections
import weakref

import torch
import torch.distributed as dist

from .. import _agree, _dist, config
from .._dist import group_key
from ..collectives import gather_sequence
from ..ring.attn import masked_attention
from .._plans import lookup, register, warm_up_error
from . import policy
from . import fp8
from .fill import rms_norm_rope
from .forward_checks import (JOINT_POSITIONS, joint_error, qkv_error, joint_checksum, joint_key,
                             mask_error, payload_error)
from .forward_plan import ForwardPlan
from .pipeline_choice import (MAX_GROUPS, MIN_WAVES, PipelineDecision, auto_groups,
                              choose_groups, fits)
from .policy import (BACKEND_CODES, _norm_seq_lens, on_forget, resolve_backend, seq_key,
                     seq_lens_detail, seq_lens_hash)

__all__ = ["UlyssesAttention", "sdpa_attention", "rms_norm_rope", "auto_groups",
           "MAX_GROUPS", "MIN_WAVES"]

def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   causal: bool, *, key_padding_mask: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """The default ``attn_fn``: PyTorch SDPA, scale ``1/√D``.

    ``q [B, S, h, D]``, ``k [B, S, g, D]``, ``v [B, S, g, Dv]`` with ``h % g == 0`` (query head i
    uses KV head ``i // (h / g)``) → ``[B, S, h, Dv]``. ``key_padding_mask``: bool ``[B, S]``
    (True = attend) or None; a row with no key to attend is 0."""
    if key_padding_mask is not None:
        return _masked_sdpa(q, k, v, causal, key_padding_mask)
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


def _masked_sdpa(q, k, v, causal: bool, key_padding_mask: torch.Tensor) -> torch.Tensor:
    """``sdpa_attention`` with a key-padding mask. CUDA: the ring's ``masked_attention``
    (non-causal: each batch row's attended keys gathered to the front, FlashAttention-2's
    varlen kernel, GQA in the kernel; causal: the mask as a −inf bias to cuDNN's kernel). CPU:
    SDPA with the mask broadcast over heads and queries, one call per head as the unmasked
    path. Rows without a key are 0."""
    h, g = q.shape[2], k.shape[2]
    if h == 0:
        return q.new_empty(q.shape[0], q.shape[1], 0, v.shape[3])
    if q.is_cuda:
        return masked_attention(q, k, v, causal, key_padding_mask)[0].to(q.dtype)
    if g != h:
        k = k.repeat_interleave(h // g, dim=2)
        v = v.repeat_interleave(h // g, dim=2)
    sq = q.shape[1]
    allowed = key_padding_mask.bool()[:, None, None, :]
    if causal:
        allowed = allowed & torch.ones(sq, k.shape[1], dtype=torch.bool,
                                       device=q.device).tril()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    heads = [slice(i, i + 1) for i in range(h)] if q.device.type == "cpu" else [slice(0, h)]
    outs = [sdpa(q[:, :, i].transpose(1, 2), k[:, :, i].transpose(1, 2),
                 v[:, :, i].transpose(1, 2), attn_mask=allowed) for i in heads]
    out = torch.cat(outs, dim=1).transpose(1, 2)
    has = allowed.any(-1)[:, 0, :, None, None]  # [B, Sq, 1, 1]: the row has a key
    return out.masked_fill(~has, 0.0)


class UlyssesAttention(_dist.Lifecycle, torch.nn.Module):
    """Attention over the whole sequence on sequence-sharded inputs (DeepSpeed-Ulysses).

    Arguments:
        attn_fn: ``attn_fn(q [B, S, h, D], k [B, S, g, D], v [B, S, g, Dv], causal) →
            [B, S, h, Dv]`` with ``h % g == 0`` and query head i using KV head ``i // (h/g)``
            (default: ``sdpa_attention``); its result is a tensor of its own, not memory it
            reuses on the next call (with one rank, one head group and no joint rows, a
            contiguous result of q's dtype is the forward's result, no copy made). It must not
            write into q, k, v nor return them: with one rank and nothing to pack (no joint
            rows, FP8 payload, or norm/RoPE in the fill) they are the caller's tensors (or
            views of them).
        group: process group (None: default) or an engine's group coordinator (``device_group``
            + ``cpu_group``).
        backend: ``"all_to_all"``, ``"ce"`` or ``"auto"`` (env ``ATTNCOMM_ULYSSES_BACKEND``).
        pipeline_groups: −1 automatic (env ``ATTNCOMM_ULYSSES_PIPELINE_GROUPS``): decided per
            forward shape by measurement on CUDA (``pipeline_decision``), sequential on CPU;
            0 or 1 (one head group) sequential; N ≥ 2 forces N head groups (group g+1's fill
            and exchange issued before group g's attention). Any G ≥ 2 runs only when every
            rank has room for two groups' working sets (agreed before any allocation), else
            every rank runs sequentially.
        qk_norm: ``(q_weight [D], k_weight [D], eps)`` RMSNorm for q and k, or None.
        timeout_s: wait budget (None: ``ATTNCOMM_TIMEOUT_S``).
        fuse_qk_norm_rope: norm + RoPE inside the fill that packs the send buffer (True: one
            pass over q, k, v) or as their own pass over the local shard before the transport
            packs (False); the results are bitwise equal.
        fill_impl: the fill's implementation: ``"auto"`` (the Triton kernel for CUDA tensors
            with a power-of-two head_dim, else torch ops), ``"triton"`` or ``"torch"``; the
            same bits either way.
        validate: cross-rank argument check (None → env ``ATTNCOMM_VALIDATE``: unset, on the
            first forward with a new signature per group; True every forward; False never).
        payload_dtype: None (q, k, v travel in their dtype) or ``torch.float8_e4m3fn``: they
            travel as e4m3 rows with one fp32 scale per (token, head) (``ulysses/fp8.py``: the
            rule, its error bound and the ``D + 4``-byte wire rows; the fill quantizes while it
            packs) and are dequantized to their dtype on arrival, before attention; the output
            exchange stays in the input dtype. Lossy, so off by default. Needs fp16/bf16/fp32.

    ``forward(q [B, S_r, Hq, D], k [B, S_r, Hkv, D], v [B, S_r, Hkv, Dv], *, seq_lens=None,
    causal=False, rope=None, joint=None, joint_position="front") → [B, S_r, Hq, Dv]``;
    ``rope=(cos, sin)`` each ``[S, D]`` over global positions. Query head h attends with KV head
    ``h // (Hq / Hkv)``; each rank receives the KV heads its query heads use and expands them
    locally when its grouping is not uniform.

    Joint rows (MMDiT joint attention: a DiT's text tokens beside its sequence-sharded image
    tokens): ``joint=(q_j [B, S_j, Hq, D], k_j [B, S_j, Hkv, D], v_j [B, S_j, Hkv, Dv])``, the
    same on every rank (q, k, v's dtypes and device), stay out of the exchange: each rank takes
    its own heads of them locally and attention runs, non-causal, over the concatenation
    ``[joint; sequence]`` (``joint_position="front"``) or ``[sequence; joint]`` (``"back"``):
    ``attn_fn`` receives q, k, v of ``S_j + S`` rows in that order (the joint rows' heads copied
    into the rows of the buffer the exchange lands in, so no concatenation pass). The joint
    rows' output is then gathered over heads (one exchange of the same transport), and the call
    returns ``(out [B, S_r, Hq, Dv], joint_out [B, S_j, Hq, Dv])`` with every head of
    ``joint_out`` on every rank. ``qk_norm``, ``rope`` and the FP8 payload apply to the
    sequence rows only: joint rows enter as passed (models norm and rotate their streams with
    their own weights).

    Key-padding masks: ``key_padding_mask`` (bool ``[B, S_r]``, True = attend) masks this
    rank's keys, sharded like k; ``joint_key_padding_mask`` (bool ``[B, S_j]``, the same on
    every rank) masks the joint rows' keys (a DiT's padded text tokens). The masks are
    gathered over the group (one small all_gather) into the mask of the rows attention runs
    over (``[joint; sequence]`` or ``[sequence; joint]``; a missing one is all True) and
    ``attn_fn`` is called with ``key_padding_mask=`` that ``[B, S_j + S]`` mask (only when a
    mask is given). A row with no key to attend is 0. The masks are tensors of the compiled
    op, so one graph serves every mask of a shape.

    Attributes (of the last forward):
        fallback_reason: why it did not take ``ce`` for some exchange with ``backend="auto"``
            (None when every exchange that could use ``ce`` did, or the message was small
            enough for ``all_to_all`` to be the choice).
        last_backends: the transports it used, e.g. ``{"in": "ce", "out": "ce"}`` (and
            ``"joint"``: the joint rows' head gather).
        pipeline_decision: with ``pipeline_groups=-1``, the ``PipelineDecision`` of the
            forward's shape (``groups``, ``candidate_groups``, ``sequential_us``,
            ``pipelined_us``: the slowest rank's median µs per forward, and
            ``fallback_reason`` when sequential was kept: not measured on CPU, no split, the
            outputs differed, measured slower); None otherwise. On the first CUDA forward with
            a new agreed signature, the sequential forward and the pipelined one with
            ``auto_groups``' count are each run and compared bit for bit, then timed (median
            of a few forwards), and the faster is kept for that shape (cached per group and
            signature: the other modules of a model with the same shapes reuse it).
        last_pipeline_groups: its head groups (1: sequential).
        last_in_exchanges: input exchanges per head group (1 when q, k, v share dtype and
            head_dim and so travel together).

    CUDA graphs and torch.compile: after one eager forward of a shape (on every rank), a forward
    of that shape can be captured in a CUDA graph (sequential or pipelined, either transport,
    the fill included); replays give the eager result bit for bit with no host work. Under
    ``torch.compile(fullgraph=True)`` the forward is one custom op that runs the plan of that
    eager forward (``attn_fn`` runs inside it, uncompiled). A shape first seen inside a capture
    or a trace raises ``ValueError`` saying to warm it up eagerly. The module owns no memory of
    its own: its ``ce`` staging is the process-wide transport's, shared with every module and
    functional call on the group (one set of slots per shape bucket, not one per layer), freed
    by ``attncomm.release(group)``; ``close()`` drops its per-shape plans (nothing collective).

    Raises:
        ValueError (every rank): not 4-D tensors, ``Hq % Hkv != 0``, mismatched shapes across
        tensors or ranks, bad ``seq_lens``/``rope``/``qk_norm``/``pipeline_groups`` (also from
        env ``ATTNCOMM_ULYSSES_PIPELINE_GROUPS``), joint rows with ``causal=True``, of the wrong
        shapes, dtypes or device, or (when the call is checked) with different bits on
        different ranks, a bad ``joint_position``, a key-padding mask that is not bool of its
        rows' shape on q's device (or given on some ranks only), a joint mask without joint
        rows, an FP8 payload with inputs that are not fp16/bf16/fp32; PeerTimeoutError when a
        peer does not answer.
    """

    def __init__(self, attn_fn=None, group=None, *, backend: str = "auto",
                 pipeline_groups: int = -1, qk_norm=None, timeout_s: float | None = None,
                 fuse_qk_norm_rope: bool = True, validate: bool | None = None,
                 fill_impl: str = "auto", payload_dtype: torch.dtype | None = None):
        super().__init__()
        if payload_dtype is not None and payload_dtype != fp8.FP8_DTYPE:
            raise ValueError(f"payload_dtype must be None or torch.float8_e4m3fn, got "
                             f"{payload_dtype!r}")
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
        self.group, self.backend, self.pipeline_groups = group, backend, pipeline_groups
        self.qk_norm, self.timeout_s, self.validate = qk_norm, timeout_s, validate
        self.fuse_qk_norm_rope, self.fill_impl = fuse_qk_norm_rope, fill_impl
        self.payload_dtype = payload_dtype
        self.__dict__["_pg"] = _UNRESOLVED  # the resolved process group, on the first forward
        self.__dict__["_plans"] = collections.OrderedDict()   # plan key → ForwardPlan
        self.__dict__["_last"] = None      # the last forward's plan
        self.__dict__["_op_name"] = None   # the name traced graphs call it by (first plan)
        _LIVE.add(self)

    def __setattr__(self, name, value) -> None:
        super().__setattr__(name, value)
        if name in _PLAN_INPUTS:  # a setting a plan was made from: plan again
            self.__dict__.get("_plans", {}).clear()
            if name == "group":
                self.__dict__["_pg"] = _UNRESOLVED

    @property
    def fallback_reason(self) -> str | None:
        return self._last.fallback_reason if self._last is not None else None

    @property
    def last_backends(self) -> dict:
        return dict(self._last.backends) if self._last is not None else {}

    @property
    def last_pipeline_groups(self) -> int:
        return self._last.n_groups if self._last is not None else 0

    @property
    def last_in_exchanges(self) -> int:
        return self._last.in_exchanges if self._last is not None else 0

    @property
    def pipeline_decision(self) -> PipelineDecision | None:
        return self._last.decision if self._last is not None else None

    def _release(self) -> None:
        self._plans.clear()
        self.__dict__["_last"] = None

    def __getstate__(self) -> dict:
        # A copy (deepcopy, pickle) plans anew: plans hold transports and device tensors.
        state = dict(self.__dict__)
        for name in ("_plans", "_last", "_pg", "_op_name"):
            state.pop(name, None)
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        # Set here, not carried in the state: a copied _UNRESOLVED would be another object.
        self.__dict__.update(_plans=collections.OrderedDict(), _last=None, _pg=_UNRESOLVED,
                             _op_name=None)
        _LIVE.add(self)

    # ----------------------------------------------------------------------------- checks
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

    # ----------------------------------------------------------------------------- forward
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq_lens=None,
                causal: bool = False, rope=None, joint=None, joint_position: str = "front",
                key_padding_mask: torch.Tensor | None = None,
                joint_key_padding_mask: torch.Tensor | None = None):
        masks = (key_padding_mask, joint_key_padding_mask)
        if torch.compiler.is_compiling():
            return self._traced_forward(q, k, v, seq_lens, causal, rope, joint, joint_position,
                                        masks)
        return self._forward(q, k, v, seq_lens, causal, rope, joint, joint_position, masks)

    def _forward(self, q, k, v, seq_lens, causal, rope, joint=None, joint_position="front",
                 masks=(None, None)):
        """The eager forward: the plan of this shape (made on its first forward), run."""
        if self._closed:
            self._ensure_open()
        given = _mask_keys(masks)
        try:
            key = self._plan_key((q.shape, q.dtype, q.device), (k.shape, k.dtype, k.device),
                                 (v.shape, v.dtype, v.device), seq_lens, causal,
                                 None if rope is None else (rope[0].shape, rope[1].shape),
                                 None if joint is None else joint_key(joint), joint_position,
                                 given)
            plan = self._plans.get(key)
        except (AttributeError, TypeError, IndexError, ValueError):  # the checks say what
            key, plan = None, None
        if plan is None:
            plan = self._make_plan(q, k, v, seq_lens, causal, rope, joint, joint_position, key,
                                   masks)
        elif plan.every:
            sig, labels, error, timeout = plan.validation
            if sig[-1] != -1:  # the joint rows' checksum: of this call's rows
                sig = sig[:-1] + [joint_checksum(joint)]
            _agree.validate_args(self._pg, "UlyssesAttention", sig, labels, error, timeout,
                                self.validate)
        self.__dict__["_last"] = plan
        if given is _NO_MASKS:
            return plan.run(q, k, v, rope, joint)
        return plan.run(q, k, v, rope, joint, key_mask=self._gather_mask(plan, masks, q))

    def _gather_mask(self, plan: ForwardPlan, masks, q) -> torch.Tensor:
        """The key mask of the rows attention runs over, ``[B, S_j + S]`` bool: the ranks'
        masks gathered in rank order, the joint rows' at their side (all True where none)."""
        mask, jmask = masks
        b, s_j = q.shape[0], plan.s_j
        if mask is None:
            full = torch.ones(b, plan.s_total, dtype=torch.bool, device=q.device)
        else:
            timeout = plan.validation[3]  # the plan's budget (the environment read once)
            full = gather_sequence(mask.contiguous(), plan.seq, self._pg, lambda work: _dist.wait(
                work, self._pg, "UlyssesAttention key_padding_mask gather", timeout))
        if not plan.joint:
            return full
        if jmask is None:
            jmask = torch.ones(b, s_j, dtype=torch.bool, device=q.device)
        return torch.cat([jmask, full] if plan.front else [full, jmask], dim=1)

    def _make_plan(self, q, k, v, seq_lens, causal, rope, joint, position, key,
                   masks=(None, None)) -> ForwardPlan:
        """The checks (local, then across ranks on a new signature), the head groups (measured
        for ``pipeline_groups=-1`` on CUDA) and the transports of a new forward shape: its
        ``ForwardPlan``."""
        if self._pg is _UNRESOLVED:  # a coordinator's device_group; the check once
            self.__dict__["_pg"] = _dist.resolve_group(self.group, "UlyssesAttention")
        if self._op_name is None:
            self.__dict__["_op_name"] = register(self)
        group = self._pg
        world, rank = dist.get_world_size(group), dist.get_rank(group)
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
        error, dims6, seq = qkv_error(q, k, v, seq_in, rope, self.qk_norm, world, rank, error)
        j_err, s_j = joint_error(joint, position, causal, dims6, (q, k, v))
        error = error or j_err or payload_error(self.payload_dtype, (q, k, v))
        error = error or mask_error(masks, joint, dims6, s_j, q)
        mode = config.validation_mode(self.validate)
        checksum = (joint_checksum(joint) if error is None and joint is not None and world > 1
                    and mode != "never" else -1)
        sig, labels = self._signature(q, k, v, joint, error, dims6, seq_in, seq, backend, causal,
                                      rope, groups, s_j, position, checksum)
        # the masks given (before the checksum, which stays the last entry)
        sig[-1:-1] = [int(masks[0] is not None), int(masks[1] is not None)]
        labels[-1:-1] = ["key_padding_mask given", "joint_key_padding_mask given"]
        b, s_r, hq, hkv, d, dv = dims6
        if error is None and policy.capturing(q):
            raise warm_up_error("UlyssesAttention", f"the forward shape q {list(q.shape)}, "
                                f"k {list(k.shape)}, v {list(v.shape)}, {q.dtype}")
        validation = (sig, labels, error, timeout)
        _agree.validate_args(group, "UlyssesAttention", *validation, self.validate,
                            detail=seq_lens_detail(group, seq, timeout))
        dims = (b, hq, hkv, d, dv)
        jspec = None if joint is None else (s_j, position == "front")
        rows = sum(seq) + max(s_j, 0)
        facts = policy.transport_facts(group, backend, q.device)  # probed before any plan

        def build(n: int) -> ForwardPlan:
            return ForwardPlan(self, group, rank, world, dims, seq, facts, timeout, n, q, k, v,
                               rope is not None, causal, jspec, self.payload_dtype)

        if groups == -1:
            signature = ("UlyssesAttention", *sig[:-1], bool(self.fuse_qk_norm_rope),
                         self.fill_impl, _fn_name(self.attn_fn))  # sig[-1]: data, not shape
            plan, decision = choose_groups(group, signature, build,
                                           lambda p: p.run(q, k, v, rope, joint), q.device,
                                           dims, rows, seq)
            plan.decision = decision
        else:
            plan = build(1 if groups < 2 or not fits(group, groups, q.device, dims, seq, rows)
                         else groups)
        plan.every = mode == "every"
        plan.validation = validation
        if key is not None:
            plans = self._plans
            plans[key] = plan
            while len(plans) > PLANS_PER_MODULE:
                plans.popitem(last=False)
        return plan

    def _signature(self, q, k, v, joint, error, dims6, seq_in, seq, backend, causal, rope,
                   groups, s_j, position, checksum) -> tuple[list, list]:
        """The forward's signature (ints every rank must agree on) and its labels; the joint
        rows' checksum is the last entry."""
        ok = error is None
        b, s_r, hq, hkv, d, dv = dims6
        codes = [_agree.DTYPE_CODES.get(t.dtype, 0) if isinstance(t, torch.Tensor) else 0
                 for t in (q, k, v)]
        jcodes = ([_agree.DTYPE_CODES.get(t.dtype, 0) for t in joint] if ok and joint is not None
                  else [0, 0, 0])
        pos = JOINT_POSITIONS.index(position) if position in JOINT_POSITIONS else -1
        sig = [b, hq, hkv, d, dv, *codes, int(bool(q.is_cuda)) if ok else -1,
               BACKEND_CODES[backend], int(bool(causal)), int(rope is not None),
               int(self.qk_norm is not None), s_r if seq_in is None else -1,
               sum(seq) if ok else -1, seq_lens_hash(seq) if ok else -1, groups,
               int(self.payload_dtype is not None), s_j, *jcodes, pos, checksum]
        labels = ["B", "Hq", "Hkv", "D", "Dv", "q dtype", "k dtype", "v dtype", "CUDA",
                  "backend", "causal", "rope given", "qk_norm given", "S_r (seq_lens=None)",
                  "sum(seq_lens)", "seq_lens (hash)", "pipeline_groups", "payload_dtype fp8",
                  "S_j (joint rows, -1: none)", "q_j dtype", "k_j dtype", "v_j dtype",
                  "joint_position (0: front, 1: back)", "joint rows (CRC-32 of their bytes)"]
        return sig, labels

    def _plan_key(self, qd, kd, vd, seq_lens, causal, rope_shapes, jkey=None,
                  position="front", masks=(None, None)) -> tuple:
        """A forward's plan key from its tensors' (shape, dtype, device), ``seq_lens``, causal,
        the rope tensors' shapes, the joint rows' (shape, dtype, device) and position and the
        masks' (``_mask_keys``): the same for an eager forward and a traced one of the same
        shape. The ``ATTNCOMM_*`` variables are read when a plan is made, not per call: a
        change takes effect at the next new plan, or for every shape after
        ``attncomm.release(group)``."""
        seq = seq_lens if seq_lens is None or type(seq_lens) is tuple else seq_key(seq_lens)
        return (qd, kd, vd, seq, bool(causal), rope_shapes, jkey, position, masks)

    def _traced_forward(self, q, k, v, seq_lens, causal, rope, joint, position,
                        masks=(None, None)):
        """The forward under torch.compile: one custom op (``ulysses/ops.py``) that runs the
        plan an eager forward of this shape made (the warm-up error when there is none)."""
        jkey = None if joint is None else tuple((tuple(t.shape), t.dtype, t.device)
                                                for t in joint)
        name = _traced_plan(self._op_name, bool(self._closed),
                            (tuple(q.shape), q.dtype, q.device),
                            (tuple(k.shape), k.dtype, k.device),
                            (tuple(v.shape), v.dtype, v.device), seq_lens, causal,
                            None if rope is None else (tuple(rope[0].shape),
                                                       tuple(rope[1].shape)), jkey, position,
                            _mask_keys(masks))
        cos, sin = rope if rope is not None else (None, None)
        seq = None if seq_lens is None else [int(s) for s in seq_lens]
        if joint is None:
            return torch.ops.attncomm.ulysses_attention(q, k, v, cos, sin, name, bool(causal),
                                                        seq, masks[0])
        return torch.ops.attncomm.ulysses_attention_joint(q, k, v, cos, sin, *joint, name,
                                                          bool(causal), seq, position == "front",
                                                          *masks)


_UNRESOLVED = object()
#: Settings a plan is made from: setting one of them drops the module's plans.
_PLAN_INPUTS = frozenset({"attn_fn", "group", "backend", "pipeline_groups", "qk_norm",
                          "timeout_s", "fuse_qk_norm_rope", "fill_impl", "validate",
                          "payload_dtype"})
#: Forward shapes a module keeps plans for (least recently made dropped first).
PLANS_PER_MODULE = 64
#: Live modules, whose plans ``reset_transports`` / ``attncomm.release`` drop with the group's
#: transports (the custom op finds a module by its ``_plans.register`` name).
_LIVE: weakref.WeakSet = weakref.WeakSet()


@on_forget
def _forget(key) -> None:
    for mod in list(_LIVE):
        if mod._pg is not _UNRESOLVED and group_key(mod._pg) == key:
            mod._plans.clear()
            mod.__dict__["_last"] = None


def _mask_keys(masks) -> tuple:
    """The masks' part of a plan key: ``(shape, dtype, device)`` of each, or None. A mask of
    another shape, dtype or device is a new plan, so its check runs on every rank alike."""
    if masks[0] is None and masks[1] is None:
        return _NO_MASKS  # the common call: nothing built
    return tuple(None if m is None else (tuple(m.shape), m.dtype, m.device) for m in masks)


_NO_MASKS = (None, None)


@torch.compiler.assume_constant_result
def _traced_plan(name, closed, qd, kd, vd, seq_lens, causal, rope_shapes, jkey,
                 position, masks=(None, None)) -> str:
    """``name`` (the module's, given by its first eager plan), after checking that an eager
    forward planned this shape (the warm-up error otherwise). Run by torch.compile while it
    traces; its result is a constant of the graph. Its arguments are constants (a string and
    tuples), never the module: torch 2.11's dynamo cannot pass a module to a constant function."""
    if closed:  # a closed module says so (its plans are gone), warmed up or not
        raise _dist.Lifecycle.closed_error("UlyssesAttention")
    mod = lookup(name, missing_ok=True) if name is not None else None
    key = None if mod is None else mod._plan_key(qd, kd, vd, seq_lens, causal, rope_shapes,
                                                 jkey, position, masks)
    if mod is None or key not in mod._plans:
        shapes = ", ".join(f"{n} {list(d[0])}" for n, d in zip("qkv", (qd, kd, vd)))
        raise warm_up_error("UlyssesAttention", f"the forward shape {shapes}, {qd[1]}")
    return name


def _fn_name(fn) -> str:
    """A name of ``attn_fn`` that is the same on every rank (its qualified name)."""
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _pipeline_groups_error(g) -> str | None:
    if isinstance(g, bool) or not isinstance(g, int) or g < -1:
        return "must be -1 (auto), 0 or 1 (sequential) or N ≥ 2 (head groups)"
    return None
