"""USP: Ulysses inside a node × ring attention across nodes (unified sequence parallelism).

The sequence is sharded over ``U·R`` ranks arranged as a grid: global rank
``g = ring_index · U + ulysses_index``. A Ulysses group is ``U`` consecutive ranks (one node on a
normal launch); a ring group is the ``R`` ranks with the same Ulysses index (strided). A forward:

1. Ulysses all-to-all inside each Ulysses group (``UlyssesAttention``: its transports, ``ce``
   where eligible, its fused RMSNorm + RoPE and head-group pipelining): every rank of Ulysses
   group j gets ``Hq / U`` heads of the group's whole span of the sequence;
2. ring attention over the ring group on that span (``attncomm.ring``: K/V blocks around the ring,
   online LSE merge);
3. Ulysses all-to-all back to the sequence-sharded layout.

Layout (which positions rank g holds). The sequence of ``S`` positions is first arranged for the
ring, then cut into ``U·R`` contiguous pieces; rank g holds piece g:

- ``layout="contiguous"``: the sequence as it is. Rank g holds ``[g·S/(UR), (g+1)·S/(UR))``; the
  Ulysses group j holds the contiguous span ``[j·S/R, (j+1)·S/R)``, which is ring rank j's
  contiguous block.
- ``layout="zigzag"`` (causal load balance over the ring): the sequence is cut into 2R chunks and
  reordered as ``[c_0, c_{2R−1}, c_1, c_{2R−2}, …]`` (ring rank j's zigzag shard, ``j = 0..R−1``,
  one after the other); rank g holds piece g of that order. After the Ulysses all-to-all the
  group j holds exactly ``[c_j; c_{2R−1−j}]``, ring rank j's zigzag block
  (yunchang's ``zigzag_extract_local``). ``usp_shard`` / ``usp_unshard`` / ``usp_positions``
  compute these pieces. With packed sequences (``cu_seqlens``) the ring's order zigzags every
  sequence on its own (``zigzag_shard(..., cu_seqlens=)`` over R), then is cut the same way.

Sources: Fang & Zhao, "USP: A Unified Sequence Parallelism Approach for Long Context Generative
AI", 2024, arXiv:2405.07719 (yunchang / xDiT ``LongContextAttention``, Ulysses on low ranks);
SGLang diffusion composes Ulysses on contiguous ranks with ring on strided ranks the same way.
``(U, 1)`` is ``UlyssesAttention`` and ``(1, R)`` is ``ring_attention``, bit for bit.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import _agree, _dist, collectives, config
from ._plans import lookup, register
from .capability import host_identity
from .ring.api import LAYOUT_CODES, cu_signature, key_mask_error, local_error, read_cu, \
    ring_attention
from .ring.layout import cu_seqlens_error, layout_error, zigzag_shard, zigzag_unshard
from .ulysses import UlyssesAttention
from .ulysses.api import seq_lens_hash
from .ulysses.policy import BACKEND_CODES

__all__ = ["make_groups", "USPAttention", "usp_shard", "usp_unshard", "usp_positions",
           "ulysses_span_reason", "UlyssesSpansHostsWarning"]



class UlyssesSpansHostsWarning(UserWarning):
    """A Ulysses group of USP spans more than one host: its all-to-all leaves the NVLink
    domain (and single-host transports are off for it)."""


# ------------------------------------------------------------------------------ layout

def _validate_grid(seq_len: int, u: int, r: int, layout: str) -> None:
    if u < 1 or r < 1:
        raise ValueError(f"ulysses_degree and ring_degree must be ≥ 1, got {u} and {r}")
    why = layout_error(layout)
    if why:
        raise ValueError(why)
    parts = u * r * (2 if layout == "zigzag" else 1)
    if seq_len % parts:
        raise ValueError(f"layout={layout!r} with U = {u}, R = {r}: a sequence of {seq_len} "
                         f"positions does not split into {parts} equal chunks")


def usp_shard(x: torch.Tensor, ulysses_degree: int, ring_degree: int, rank: int,
              layout: str = "contiguous", dim: int = 1, *, cu_seqlens=None) -> torch.Tensor:
    """Global rank ``rank``'s piece of the whole tensor ``x`` (sequence along ``dim``) under the
    module docstring's layout: ``zigzag`` → ``zigzag_shard(x, R, rank // U, cu_seqlens=)`` cut
    into U equal pieces, piece ``rank % U``; ``contiguous`` → piece ``rank`` of ``U·R``. A new
    tensor.

    Raises ValueError when the length does not split (``U·R``; ``2·U·R`` for zigzag; with
    ``cu_seqlens`` and zigzag, every sequence's length by ``2·R``)."""
    u, r = ulysses_degree, ring_degree
    _validate_grid(x.shape[dim], u, r, layout)
    if not 0 <= rank < u * r:
        raise ValueError(f"usp_shard: rank {rank} is not in [0, {u * r})")
    span = (zigzag_shard(x, r, rank // u, dim, cu_seqlens=cu_seqlens) if layout == "zigzag"
            else x)
    n = x.shape[dim] // (u * r)
    start = (rank % u if layout == "zigzag" else rank) * n
    return span.narrow(dim, start, n).clone()


def usp_unshard(shards: Sequence[torch.Tensor], ulysses_degree: int, ring_degree: int,
                layout: str = "contiguous", dim: int = 1, *, cu_seqlens=None) -> torch.Tensor:
    """The whole tensor back from every global rank's piece (``shards[g]``, rank order): the
    inverse of ``usp_shard`` (with the same ``cu_seqlens``)."""
    u, r = ulysses_degree, ring_degree
    if len(shards) != u * r:
        raise ValueError(f"usp_unshard: {len(shards)} shards for U·R = {u * r} ranks")
    ring_shards = [torch.cat(list(shards[j * u:(j + 1) * u]), dim=dim) for j in range(r)]
    if layout == "zigzag":
        return zigzag_unshard(ring_shards, dim=dim, cu_seqlens=cu_seqlens)
    why = layout_error(layout)
    if why:
        raise ValueError(why)
    return torch.cat(ring_shards, dim=dim)


def usp_positions(seq_len: int, ulysses_degree: int, ring_degree: int, rank: int,
                  layout: str = "contiguous", *, cu_seqlens=None) -> torch.Tensor:
    """The global positions (int64) rank ``rank`` holds (``usp_shard`` of ``arange``)."""
    return usp_shard(torch.arange(seq_len), ulysses_degree, ring_degree, rank, layout, dim=0,
                     cu_seqlens=cu_seqlens)


def _span_rows(t: torch.Tensor, ring_index: int, ring_degree: int, span: int, layout: str,
               cu=None):
    """Rows of ``t [S, ...]`` for ring rank ``ring_index``'s block of ``span`` positions."""
    if layout == "contiguous":
        return t[ring_index * span:(ring_index + 1) * span]
    return zigzag_shard(t, ring_degree, ring_index, dim=0, cu_seqlens=cu)


# ------------------------------------------------------------------------------ groups

def _hosts_text(ranks: Sequence[int], hosts: Sequence[str]) -> str | None:
    by_host: dict = {}
    for rk, h in zip(ranks, hosts):
        by_host.setdefault(h, []).append(rk)
    if len(by_host) < 2:
        return None
    parts = "; ".join(f"{h}: ranks {rs}" for h, rs in by_host.items())
    return (f"Ulysses group {list(ranks)} spans {len(by_host)} hosts ({parts}): its all-to-all "
            f"leaves the NVLink domain; keep ulysses_degree within one host (ranks of one "
            f"host consecutive)")


_HOST_BYTES = 256


def _gather_hosts(group, timeout_s: float | None = None) -> list[str]:
    """Every rank's ``capability.host_identity()`` (group rank order), gathered over the gloo
    twin of ``group`` as fixed-size byte rows, the wait bounded by ``timeout_s``."""
    g = _dist.cpu_group(group)
    world = dist.get_world_size(g)
    raw = host_identity().encode()[:_HOST_BYTES]
    row = torch.zeros(_HOST_BYTES, dtype=torch.uint8)
    if raw:
        row[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    rows = torch.empty(world * _HOST_BYTES, dtype=torch.uint8)
    budget = config.timeout_s(timeout_s)
    _dist.wait(collectives.all_gather_tensor(rows, row, group=g, async_op=True), g,
               "usp host check", budget)
    return [bytes(r.tolist()).rstrip(b"\0").decode(errors="replace")
            for r in rows.view(world, _HOST_BYTES)]


def ulysses_span_reason(ulysses_group, timeout_s: float | None = None) -> str | None:
    """Why ``ulysses_group`` is a poor Ulysses group (it spans hosts, by
    ``capability.host_identity()`` gathered over the group), or None. Collective over the
    group's gloo twin, bounded by ``timeout_s``."""
    hosts = _gather_hosts(ulysses_group, timeout_s)
    ranks = (list(range(len(hosts))) if ulysses_group is None
             else dist.get_process_group_ranks(ulysses_group))
    return _hosts_text(ranks, hosts)


def make_groups(ulysses_degree: int, ring_degree: int, group=None):
    """The Ulysses and ring groups of a ``U × R`` USP grid over ``group``'s ranks.

    Global rank ``g = ring_index · U + ulysses_index`` (``g`` in ``group``'s numbering): the
    Ulysses group of ``g`` is ranks ``[ring_index·U, (ring_index+1)·U)`` (consecutive: one node
    on a normal launch), its ring group the ranks ``ulysses_index + j·U`` for ``j < R``.

    Collective. ``group=None``: every rank of the default group calls it (it creates every
    Ulysses and ring group with ``dist.new_group``, in the same order everywhere). A subgroup:
    only its members call, once per subgroup (groups with torch's local synchronisation; a
    degree equal to the group's size reuses ``group`` itself).

    Returns:
        ``(ulysses_group, ring_group)`` of this rank.

    Raises:
        ValueError (every rank): degrees below 1, or ``U · R`` ≠ the group's size, or ranks that
        disagree on the degrees. Warns ``UlyssesSpansHostsWarning`` (on every rank, the same
        text) when a Ulysses group spans hosts.
    """
    u, r = ulysses_degree, ring_degree
    world = dist.get_world_size(group)
    error = None
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (u, r)) or u < 1 or r < 1:
        error = f"ulysses_degree and ring_degree must be ints ≥ 1, got {u!r} and {r!r}"
    elif u * r != world:
        error = (f"ulysses_degree · ring_degree = {u} · {r} = {u * r} does not equal the "
                 f"group's size {world}")
    sig = [u, r] if error is None else [-1, -1]
    _agree.validate_args(group, "usp.make_groups", sig, ["ulysses_degree", "ring_degree"], error,
                        config.timeout_s(), True)
    ranks = list(range(world)) if group is None else dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    j, i = divmod(me, u)
    u_ranks = [[ranks[jj * u + ii] for ii in range(u)] for jj in range(r)]
    r_ranks = [[ranks[jj * u + ii] for jj in range(r)] for ii in range(u)]
    if group is None:
        ug = [dist.new_group(x) for x in u_ranks][j]
        rg = [dist.new_group(x) for x in r_ranks][i]
    else:
        ug = group if u == world else dist.new_group(u_ranks[j], use_local_synchronization=True)
        rg = group if r == world else dist.new_group(r_ranks[i], use_local_synchronization=True)
    hosts = _gather_hosts(group)
    texts = [t for t in (_hosts_text(x, [hosts[ranks.index(y)] for y in x]) for x in u_ranks)
             if t]
    if texts:
        warnings.warn("USP: " + " | ".join(texts), UlyssesSpansHostsWarning, stacklevel=2)
    return ug, rg


# ------------------------------------------------------------------------------ module

class USPAttention(torch.nn.Module):
    """Attention over a sequence sharded on a ``U × R`` grid: Ulysses inside each Ulysses group,
    ring attention across the ring group (see the module docstring for the layout).

    Arguments:
        attn_fn: the per-block attention of the ring, ``attn_fn(q, k, v, causal) -> (out,
            lse)`` (see ``ring_attention``; None: ``ring.attention_with_lse``).
        ulysses_group, ring_group: this rank's two groups (``make_groups``).
        backend, pipeline_groups, qk_norm, timeout_s: as ``UlyssesAttention`` (the Ulysses
            transport, head-group pipelining, RMSNorm weights); ``timeout_s`` also bounds the
            ring's waits.
        validate: cross-rank argument check of each forward (None: env ``ATTNCOMM_VALIDATE``;
            unset, on the first forward with a new signature per grid; True every forward;
            False never), agreed over the whole grid (``_agree.validate_args`` with ``grid=``);
            the construction is always checked.
        layout: ``"contiguous"`` or ``"zigzag"`` (over the ring; for causal load balance).

    ``forward(q [B, S_r, Hq, D], k [B, S_r, Hkv, D], v [B, S_r, Hkv, Dv], *, seq_lens=None,
    causal=False, rope=None, key_padding_mask=None, cu_seqlens=None) → [B, S_r, Hq, Dv]`` in
    q's dtype (fp16/bf16/fp32, one dtype for q, k, v): this rank's rows of the attention over
    the whole sequence. ``seq_lens``: every rank's ``S_r`` in global rank order (``U·R``
    entries; default: all equal); every Ulysses group's total must be the same (it is a ring
    block; even for zigzag). ``rope=(cos, sin)`` each ``[S, D]`` over global positions
    (rotate-half), applied after ``qk_norm``. ``key_padding_mask``: bool ``[B, S_r]`` of this
    rank's keys (True = attend): gathered by the Ulysses exchange over the group's span, then
    passed around the ring with its K/V block. ``cu_seqlens``: int32 ``[N + 1]`` boundaries of
    packed sequences over the global order (the same on every rank; zigzag: every length
    divisible by 2R), given to the ring (``ring_attention``'s rule). A row with no key to
    attend is 0.

    torch.compile: under ``torch.compile(fullgraph=True)`` the forward is one custom op
    (``attncomm::usp_attention``) that runs this eager forward when the graph runs (checks,
    exchanges, the ring; ``attn_fn`` uncompiled inside it). The mask and ``cu_seqlens`` are
    tensors of the op, so one compiled graph serves every mask and every set of boundaries of
    a shape; boundaries not seen before make their ring plan when the graph runs (read on the
    host: pass a CPU tensor; inside CUDA graph capture the plan must exist, the warm-up rule).

    Attributes:
        topology_reason: why the Ulysses group is a poor one (it spans hosts), or None.
        fallback_reason, last_backends: the Ulysses module's (why ``auto`` did not take ``ce``;
            the transports the last forward used).

    Raises:
        ValueError (every rank of the grid): bad shapes, dtypes, seq_lens, rope, qk_norm,
        layout, or ranks that disagree; PeerTimeoutError when a peer does not answer.
    """

    def __init__(self, attn_fn=None, *, ulysses_group, ring_group, backend: str = "auto",
                 pipeline_groups: int = -1, qk_norm=None, timeout_s: float | None = None,
                 validate: bool | None = None, layout: str = "contiguous"):
        super().__init__()
        self.attn_fn = attn_fn
        self.ulysses_group, self.ring_group = ulysses_group, ring_group
        self.layout = layout
        self.timeout_s = timeout_s
        self.validate = validate
        self.qk_norm = qk_norm
        self._closed = False
        self._cu = None  # the cu_seqlens of the forward in flight, for the ring
        self._op_name = register(self)  # the compiled op finds it by this
        error = layout_error(layout)
        try:
            self._ulysses = UlyssesAttention(self._ring_attend, ulysses_group, backend=backend,
                                             pipeline_groups=pipeline_groups, qk_norm=qk_norm,
                                             timeout_s=timeout_s, validate=False)
        except ValueError as exc:
            self._ulysses, error = None, error or str(exc)
        sig = [LAYOUT_CODES.get(layout, 0), BACKEND_CODES.get(backend, 0),
               pipeline_groups if isinstance(pipeline_groups, int) else -9,
               int(qk_norm is not None), dist.get_world_size(ulysses_group),
               dist.get_world_size(ring_group)]
        _agree.validate_args(ulysses_group, "USPAttention", sig,
                            ["layout", "backend", "pipeline_groups", "qk_norm given", "U", "R"],
                            error, config.timeout_s(timeout_s), True, grid=ring_group)
        self.topology_reason = ulysses_span_reason(ulysses_group, timeout_s)

    @property
    def fallback_reason(self) -> str | None:
        return self._ulysses.fallback_reason

    @property
    def last_backends(self) -> dict:
        return self._ulysses.last_backends

    def _ring_attend(self, q, k, v, causal, key_padding_mask=None):
        # The Ulysses module's attn_fn: a ring over the group's span, checked already; the
        # packed sequences of the forward in flight (``_cu``).
        return ring_attention(q, k, v, self.ring_group, causal=causal, layout=self.layout,
                              attn_fn=self.attn_fn, validate=False, timeout_s=self.timeout_s,
                              key_padding_mask=key_padding_mask, cu_seqlens=self._cu)

    def _validate(self, q, k, v, seq_lens, rope, mask=None, cu=None):
        """``(error or None, seq_lens as a tuple, the Ulysses group's span T)``, no
        communication."""
        u, r = dist.get_world_size(self.ulysses_group), dist.get_world_size(self.ring_group)
        j = dist.get_rank(self.ring_group)
        g = j * u + dist.get_rank(self.ulysses_group)
        error = local_error(q, k, v, "contiguous")
        if error:
            return error, None, 0
        s_r, d = q.shape[1], q.shape[3]
        seq = (s_r,) * (u * r) if seq_lens is None else tuple(seq_lens)
        if len(seq) != u * r or any(not isinstance(x, int) or x < 0 for x in seq):
            return (f"seq_lens must list U·R = {u * r} ints ≥ 0 (global rank order), got "
                    f"{list(seq)}"), None, 0
        if seq[g] != s_r:
            return f"seq_lens[{g}] = {seq[g]} but q has S_r = {s_r}", None, 0
        spans = [sum(seq[jj * u:(jj + 1) * u]) for jj in range(r)]
        if len(set(spans)) > 1:
            return (f"every Ulysses group must hold the same number of positions (a ring "
                    f"block), got {spans} from seq_lens {list(seq)}"), None, 0
        why = layout_error(self.layout, spans[0])
        if why:
            return f"{why} (the Ulysses group's span)", None, 0
        why = key_mask_error(mask, q.shape[0], s_r, q.device)
        if why is None and cu is not None:
            why = cu_seqlens_error(cu, sum(seq), r, self.layout)
        if why:
            return why, None, 0
        if rope is not None:
            want = (sum(seq), d)
            shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else None
                      for t in (rope if isinstance(rope, (tuple, list)) else ())]
            if len(shapes) != 2 or any(s != want for s in shapes):
                return f"rope must be (cos, sin) tensors [S, D] = {list(want)}", None, 0
        if self.qk_norm is not None:
            qw, kw = self.qk_norm[0], self.qk_norm[1]
            if tuple(qw.shape) != (d,) or tuple(kw.shape) != (d,):
                return f"qk_norm weights must be [D] = [{d}]", None, 0
        return None, seq, spans[0]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq_lens=None,
                causal: bool = False, rope=None, key_padding_mask: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        if self._closed:
            raise RuntimeError("USPAttention: this object is closed (close() was called)")
        if torch.compiler.is_compiling():
            # One opaque op that runs this eager forward: the checks, the exchanges and the
            # ring (its cu_seqlens read on the host) happen when the graph runs, not in it.
            cos, sin = rope if rope is not None else (None, None)
            return torch.ops.attncomm.usp_attention(
                q, k, v, cos, sin, self._op_name, bool(causal),
                None if seq_lens is None else [int(x) for x in seq_lens], key_padding_mask,
                cu_seqlens)
        return self._forward(q, k, v, seq_lens, causal, rope, key_padding_mask, cu_seqlens)

    def _forward(self, q, k, v, seq_lens, causal, rope, key_padding_mask, cu_seqlens):
        budget = config.timeout_s(self.timeout_s)
        u = dist.get_world_size(self.ulysses_group)
        r, j = dist.get_world_size(self.ring_group), dist.get_rank(self.ring_group)
        cu, error = read_cu(cu_seqlens)
        try:
            if error is None:
                error, seq, span = self._validate(q, k, v, seq_lens, rope, key_padding_mask, cu)
            else:
                seq, span = None, 0
        except (TypeError, AttributeError, IndexError) as exc:
            error, seq, span = f"bad arguments: {exc}", None, 0
        ok = error is None
        dims = [-1] * 6
        if ok:  # S_r may differ between ranks when seq_lens says so (its hash is agreed)
            dims = [q.shape[0], q.shape[1] if seq_lens is None else -1, q.shape[2], q.shape[3],
                    k.shape[2], v.shape[3]]
        sig = [*dims,
               *(_agree.DTYPE_CODES.get(t.dtype, 0) if ok else 0 for t in (q, k, v)),
               int(ok and q.is_cuda), int(bool(causal)), int(rope is not None),
               sum(seq) if ok else -1, seq_lens_hash(seq) if ok else -1, u, r,
               LAYOUT_CODES.get(self.layout, 0), int(key_padding_mask is not None),
               *cu_signature(cu, cu_seqlens is not None)]
        labels = ["B", "S_r (seq_lens=None)", "Hq", "D", "Hkv", "Dv", "q dtype", "k dtype",
                  "v dtype", "CUDA", "causal", "rope given", "S", "seq_lens (hash)", "U", "R",
                  "layout", "key_padding_mask given", "cu_seqlens (N + 1, -1: none)",
                  "cu_seqlens (CRC-32)"]
        _agree.validate_args(self.ulysses_group, "USPAttention", sig, labels, error, budget,
                            self.validate, grid=self.ring_group)
        rows = None
        if rope is not None:
            rows = tuple(_span_rows(t, j, r, span, self.layout, cu) for t in rope)
        useq = None if seq_lens is None else list(seq[j * u:(j + 1) * u])
        self._cu = cu_seqlens
        try:
            return self._ulysses(q, k, v, seq_lens=useq, causal=causal, rope=rows,
                                 key_padding_mask=key_padding_mask)
        finally:
            self._cu = None

    def close(self) -> None:
        """End this object's use (and its Ulysses module's, where it has ``close``)."""
        self._closed = True
        close = getattr(self._ulysses, "close", None)
        if close is not None:
            close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------ torch.compile
@torch.library.custom_op("attncomm::usp_attention", mutates_args=())
def _usp_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos: torch.Tensor | None, sin: torch.Tensor | None, module: str,
                      causal: bool, seq_lens: list[int] | None,
                      key_padding_mask: torch.Tensor | None = None,
                      cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The eager forward of the ``USPAttention`` named ``module``: the mask and the packed
    sequences' boundaries are tensors of the op, so one compiled graph serves all of a shape
    (new boundaries make their ring plan when the graph runs: outside CUDA graph capture, the
    warm-up rule)."""
    return lookup(module)._forward(q, k, v, None if seq_lens is None else tuple(seq_lens),
                                   causal, None if cos is None else (cos, sin), key_padding_mask,
                                   cu_seqlens)


@_usp_attention_op.register_fake
def _(q, k, v, cos, sin, module, causal, seq_lens, key_padding_mask=None, cu_seqlens=None):
    err = local_error(q, k, v, "contiguous")  # while tracing, as the eager call
    if err:
        raise ValueError(f"USPAttention: invalid arguments — {err}")
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))
