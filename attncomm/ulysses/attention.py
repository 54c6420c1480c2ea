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
import itertools
import math
import weakref

import torch
import torch.distributed as dist

from .. import _dist, config
from .._dist import cpu_group, group_key
from . import policy
from .fill import rms_norm_rope
from .forward_plan import ForwardPlan
from .layout import head_split
from .policy import (_BACKEND_CODES, _norm_seq_lens, _seq_lens_error, check_call,
                     env_key, on_forget, resolve_backend, seq_key, seq_lens_hash, warm_up_error)

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


class UlyssesAttention(_dist.Lifecycle, torch.nn.Module):
    """Attention over the whole sequence on sequence-sharded inputs (DeepSpeed-Ulysses).

    Arguments:
        attn_fn: ``attn_fn(q [B, S, h, D], k [B, S, g, D], v [B, S, g, Dv], causal) →
            [B, S, h, Dv]`` with ``h % g == 0`` and query head i using KV head ``i // (h/g)``
            (default: ``sdpa_attention``).
        group: process group (None: default) or an engine's group coordinator (``device_group``
            + ``cpu_group``).
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
        validate: cross-rank argument check (None → env ``ATTNCOMM_VALIDATE``: unset, on the
            first forward with a new signature per group; True every forward; False never).

    ``forward(q [B, S_r, Hq, D], k [B, S_r, Hkv, D], v [B, S_r, Hkv, Dv], *, seq_lens=None,
    causal=False, rope=None) → [B, S_r, Hq, Dv]``; ``rope=(cos, sin)`` each ``[S, D]`` over
    global positions. Query head h attends with KV head ``h // (Hq / Hkv)``; each rank receives
    the KV heads its query heads use and expands them locally when its grouping is not
    uniform.

    Attributes (of the last forward):
        fallback_reason: why it did not take ``ce`` for some exchange with ``backend="auto"``
            (None when every exchange that could use ``ce`` did, or the message was small
            enough for ``all_to_all`` to be the choice).
        last_backends: the transports it used, e.g. ``{"in": "ce", "out": "ce"}``.
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
        self.validate = validate
        self.__dict__["_pg"] = _UNRESOLVED  # the resolved process group, on the first forward
        self.__dict__["_plans"] = collections.OrderedDict()   # plan key → ForwardPlan
        self.__dict__["_last"] = None      # the last forward's plan
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

    def _release(self) -> None:
        self._plans.clear()
        self.__dict__["_last"] = None

    def __getstate__(self) -> dict:
        # A copy (deepcopy, pickle) plans anew: plans hold transports and device tensors.
        state = dict(self.__dict__)
        state.update(_plans=collections.OrderedDict(), _last=None, _pg=_UNRESOLVED)
        state.pop("_op_name", None)
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        _LIVE.add(self)

    # ----------------------------------------------------------------------------- checks
    def _check(self, q, k, v, seq, rope, error):
        """Local checks (no communication): ``(error or None, (B, S_r, Hq, Hkv, D, Dv), seq)``,
        the dims all 0 when q/k/v are not 4-D tensors."""
        group = self._pg
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
        world = dist.get_world_size(self._pg)
        if g == -1:
            g = 1
            if AUTO_PIPELINE and device.type == "cuda":
                sms = torch.cuda.get_device_properties(device).multi_processor_count
                g = auto_groups(head_split(hq, world), b, sum(seq), sms)
        if g < 2:
            return 1
        rank = dist.get_rank(self._pg)
        h_r = head_split(hq, world)[rank]
        item = 4  # an upper bound for fp16/bf16/fp32
        work = b * (seq[rank] * (hq + 2 * hkv) * d          # fill send buffer
                    + sum(seq) * (h_r + 2 * hkv) * d        # receive buffer (≤ all KV heads)
                    + sum(seq) * h_r * dv) * item           # attention output
        key = (dims, tuple(seq), g)
        return g if _agree_fits(self._pg, device, key, 2 * -(-work // g)) else 1

    # ----------------------------------------------------------------------------- forward
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq_lens=None,
                causal: bool = False, rope=None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._traced_forward(q, k, v, seq_lens, causal, rope)
        return self._forward(q, k, v, seq_lens, causal, rope)

    def _forward(self, q, k, v, seq_lens, causal, rope):
        """The eager forward: the plan of this shape (made on its first forward), run."""
        if self._closed:
            self._ensure_open()
        try:
            key = self._plan_key((q.shape, q.dtype, q.device), (k.shape, k.dtype, k.device),
                                 (v.shape, v.dtype, v.device), seq_lens, causal,
                                 None if rope is None else (rope[0].shape, rope[1].shape))
            plan = self._plans.get(key)
        except (AttributeError, TypeError, IndexError):  # the checks name what is wrong
            key, plan = None, None
        if plan is None:
            plan = self._make_plan(q, k, v, seq_lens, causal, rope, key)
        elif plan.every:
            check_call(self._pg, "UlyssesAttention", self.validate, *plan.check)
        self.__dict__["_last"] = plan
        return plan.run(q, k, v, rope)

    def _make_plan(self, q, k, v, seq_lens, causal, rope, key) -> ForwardPlan:
        """The checks (local, then across ranks on a new signature), the head groups and the
        transports of a new forward shape: its ``ForwardPlan``."""
        if self._pg is _UNRESOLVED:  # a coordinator's device_group; the check once
            self.__dict__["_pg"] = _dist.resolve_group(self.group, "UlyssesAttention")
        group = self._pg
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
        if ok and policy.capturing(q):
            raise warm_up_error("UlyssesAttention", f"the forward shape q {list(q.shape)}, "
                                f"k {list(k.shape)}, v {list(v.shape)}, {q.dtype}")
        check = (sig, labels, error, timeout)
        check_call(group, "UlyssesAttention", self.validate, *check, seq_lens=seq)
        dims = (b, hq, hkv, d, dv)
        n_groups = self._pipeline_groups(groups, q.device, dims, seq)
        plan = ForwardPlan(self, group, dist.get_rank(group), dist.get_world_size(group), dims,
                           seq, backend, timeout, n_groups, q, k, v, rope is not None, causal)
        plan.every = config.validation_mode(self.validate) == "every"
        plan.check = check
        if key is not None:
            plans = self._plans
            plans[key] = plan
            while len(plans) > PLANS_PER_MODULE:
                plans.popitem(last=False)
        return plan

    def _plan_key(self, qd, kd, vd, seq_lens, causal, rope_shapes) -> tuple:
        """A forward's plan key from its tensors' (shape, dtype, device), ``seq_lens``, causal,
        the rope tensors' shapes and the call-time variables: the same for an eager forward and
        a traced one of the same shape."""
        return (qd, kd, vd, seq_key(seq_lens), bool(causal), rope_shapes,
                env_key(self.backend, self.timeout_s, self.validate, self.pipeline_groups))

    def _traced_forward(self, q, k, v, seq_lens, causal, rope):
        """The forward under torch.compile: one custom op (``ulysses/ops.py``) that runs the
        plan an eager forward of this shape made (the warm-up error when there is none)."""
        name = _traced_plan(self, (tuple(q.shape), q.dtype, q.device),
                            (tuple(k.shape), k.dtype, k.device),
                            (tuple(v.shape), v.dtype, v.device), seq_lens, causal,
                            None if rope is None else (tuple(rope[0].shape),
                                                       tuple(rope[1].shape)))
        cos, sin = rope if rope is not None else (None, None)
        seq = None if seq_lens is None else [int(s) for s in seq_lens]
        return torch.ops.attncomm.ulysses_attention(q, k, v, cos, sin, name, bool(causal), seq)


_UNRESOLVED = object()
#: Settings a plan is made from: setting one of them drops the module's plans.
_PLAN_INPUTS = frozenset({"attn_fn", "group", "backend", "pipeline_groups", "qk_norm",
                          "timeout_s", "fuse_qk_norm_rope", "fill_impl", "validate"})
#: Forward shapes a module keeps plans for (least recently made dropped first).
PLANS_PER_MODULE = 64
#: Live modules, whose plans ``reset_transports`` / ``attncomm.release`` drop with the group's
#: transports; and the names the custom op finds a module by (``module_by_name``).
_LIVE: weakref.WeakSet = weakref.WeakSet()
_NAMES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_NAME_IDS = itertools.count()


@on_forget
def _forget(key) -> None:
    for mod in list(_LIVE):
        if mod._pg is not _UNRESOLVED and group_key(mod._pg) == key:
            mod._plans.clear()
            mod.__dict__["_last"] = None


@torch.compiler.assume_constant_result
def _traced_plan(mod, qd, kd, vd, seq_lens, causal, rope_shapes) -> str:
    """The name the custom op finds ``mod`` by, after checking that an eager forward planned
    this shape (the warm-up error otherwise). Run by torch.compile while it traces; its result
    is a constant of the graph."""
    mod._ensure_open()
    key = mod._plan_key(qd, kd, vd, seq_lens, causal, rope_shapes)
    if key not in mod._plans:
        shapes = ", ".join(f"{n} {list(d[0])}" for n, d in zip("qkv", key[:3]))
        raise warm_up_error("UlyssesAttention", f"the forward shape {shapes}, {key[0][1]}")
    name = mod.__dict__.get("_op_name")
    if name is None or _NAMES.get(name) is not mod:  # a copy of a module gets its own name
        name = f"UlyssesAttention#{next(_NAME_IDS)}"
        mod.__dict__["_op_name"] = name
        _NAMES[name] = mod
    return name


def module_by_name(name: str) -> UlyssesAttention:
    """The module a traced ``attncomm::ulysses_attention`` call names."""
    mod = _NAMES.get(name)
    if mod is None:
        raise RuntimeError(f"UlyssesAttention {name!r} no longer exists (the compiled graph "
                           f"outlived the module it was traced from)")
    return mod


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
