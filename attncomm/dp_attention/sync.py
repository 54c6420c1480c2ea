"""The per-step DP-attention agreement: six int64 per rank, one exchange, one decision everywhere.

With DP attention each DP rank runs its own batch through attention while the MLP runs
tensor/expert-parallel over every rank, so before the MLP every rank must know every DP rank's
token count and agree on CUDA-graph / extend / two-batch-overlap (TBO) decisions. A rank without
work joins with an idle batch. Semantics follow SGLang's ``MLPSyncBatchInfo`` and
``prepare_mlp_sync_batch_raw`` (``python/sglang/srt/managers/scheduler_dp_attn_mixin.py``), with
the bugs of that family made impossible: an IDLE batch is never counted as extend, an inactive
rank's row is replaced before anything reads it, and a rank's invalid batch makes every rank raise
instead of some ranks hanging.

Row layout: ``[num_tokens, num_tokens_for_logprob, can_cuda_graph, is_extend_in_batch,
local_can_run_tbo, local_forward_mode]``; the group holds ``dp · tp · cp`` ranks, DP major, so the
gathered rows view as ``(dp, tp·cp, 6)`` and DP rank d's row is that of its attention-TP rank 0.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence

import torch

from .._dist import resolve_group
from .rows import (ROW as _ROW, SYNC_CHOICES, SyncPlan, close_shm_channels, exchange_rows,
                   plan_for, resolve, resolve_sync, rows_for)

__all__ = ["ForwardMode", "BatchView", "MLPSyncBatchInfo", "prepare_mlp_sync_batch",
           "resolve_sync", "count_tokens", "exchange_rows", "close_shm_channels",
           "SYNC_CHOICES", "NEUTRAL_ROW"]

_IDLE = 4
_INVALID_MODE = -1  # row marker: this rank's input was invalid (every rank raises) ...
# ... and this one: a layout row [dp, tp, cp, 0, 0, _LAYOUT_MODE], sent once per layout and group
# (the first time it is used) so that every rank checks every other rank's layout.
_LAYOUT_MODE = -3
_BAD_BATCH, _BAD_SIZES, _BAD_ACTIVE = 1, 2, 3  # ... and field 0 says what was wrong
_WHY = {_BAD_BATCH: "invalid batch or counts",
        _BAD_SIZES: "dp_size·tp_size·cp_size does not match the group size",
        _BAD_ACTIVE: "invalid active_ranks"}
_I64_MAX = (1 << 63) - 1


class ForwardMode(enum.IntEnum):
    """What a batch does this step (values as in SGLang's ``ForwardMode`` subset)."""

    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    PREBUILT = 5

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_prebuilt(self) -> bool:
        return self == ForwardMode.PREBUILT

    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)


NEUTRAL_ROW = (0, 0, 1, 0, 1, int(ForwardMode.IDLE))
_MODE_OF = {int(m): m for m in ForwardMode}  # row value → ForwardMode (a dict lookup per step)
_MODE_VALUES = frozenset(_MODE_OF)


@dataclass
class BatchView:
    """What the sync reads of a scheduler's batch.

    ``extend_lens`` / ``extend_logprob_start_lens`` hold one int per request; the extend fields
    may be None unless the mode is EXTEND or MIXED (``extend_logprob_start_lens`` only matters
    with ``return_logprob``). ``inner_idle_batch`` is set by ``prepare_mlp_sync_batch`` on a
    PREBUILT batch when an idle batch must carry this rank through the step.
    """

    forward_mode: ForwardMode
    batch_size: int = 0
    extend_num_tokens: int | None = None
    extend_lens: Sequence[int] | None = None
    extend_logprob_start_lens: Sequence[int] | None = None
    return_logprob: bool = False
    inner_idle_batch: BatchView | None = None


def count_tokens(batch: BatchView | None) -> tuple[int, int]:
    """``(num_tokens, num_tokens_for_logprob)`` of a batch, by the rules of API.md.

    DECODE: the batch size (both); EXTEND/MIXED: ``extend_num_tokens``, and for logprob rows
    ``Σ max(extend_len − logprob_start_len, 1)`` when ``return_logprob`` else the batch size;
    None / IDLE / PREBUILT: 0 (an IDLE batch never takes the extend branch).

    Raises:
        ValueError for a missing or inconsistent extend field, a negative count, an unknown mode.
    """
    if batch is None:
        return 0, 0
    try:
        mode = ForwardMode(int(batch.forward_mode))
    except (ValueError, TypeError):
        raise ValueError(f"unknown forward_mode {batch.forward_mode!r}") from None
    bs = int(batch.batch_size)
    if bs < 0:
        raise ValueError(f"batch_size must be ≥ 0, got {bs}")
    if mode in (ForwardMode.IDLE, ForwardMode.PREBUILT):
        return 0, 0
    if mode == ForwardMode.DECODE:
        return bs, bs
    if batch.extend_num_tokens is None:
        raise ValueError(f"a {mode.name} batch needs extend_num_tokens, got None")
    n = int(batch.extend_num_tokens)
    if n < 0:
        raise ValueError(f"extend_num_tokens must be ≥ 0, got {n}")
    if not batch.return_logprob:
        return n, bs
    lens, starts = batch.extend_lens, batch.extend_logprob_start_lens
    if lens is None or starts is None:
        raise ValueError(f"a {mode.name} batch with return_logprob needs extend_lens and "
                         f"extend_logprob_start_lens, got {lens!r} and {starts!r}")
    if len(lens) != len(starts):
        raise ValueError(f"extend_lens has {len(lens)} entries but extend_logprob_start_lens "
                         f"has {len(starts)}")
    return n, sum(max(int(e) - int(s), 1) for e, s in zip(lens, starts))


def _local_can_run_tbo(batch: BatchView | None, num_tokens: int) -> bool:
    # An empty rank never blocks TBO; a batch with work must split into two halves of requests.
    if batch is None or num_tokens == 0:
        return True
    return int(batch.batch_size) >= 2


# -- the sync info ---------------------------------------------------------------------------

def _active_mask(active_ranks, world: int, path: str):
    """``(host list, device tensor)`` of ``active_ranks``, one of them None: a device tensor on
    the device path is fetched with the rows (one copy). Raises ValueError / TypeError."""
    if (path == "device" and isinstance(active_ranks, torch.Tensor)
            and active_ranks.device.type != "cpu"):
        if active_ranks.numel() != world:
            raise ValueError(f"active_ranks has {active_ranks.numel()} entries, the group has "
                             f"{world} ranks")
        return None, active_ranks
    vals = active_ranks.tolist() if isinstance(active_ranks, torch.Tensor) else list(active_ranks)
    if len(vals) != world:
        raise ValueError(f"active_ranks has {len(vals)} entries, the group has {world} ranks")
    return [bool(v) for v in vals], None


def _mask_rows(flat: Sequence[int], active: list) -> Sequence[int]:
    """Replace each inactive rank's row by ``NEUTRAL_ROW``, except a row that reports bad sizes
    or a bad ``active_ranks`` (those make every rank raise, whoever is active)."""
    if all(active):
        return flat
    flat = list(flat)
    for r, a in enumerate(active):
        i = r * _ROW
        if not a and not (flat[i + 5] == _INVALID_MODE and flat[i] in (_BAD_SIZES, _BAD_ACTIVE)):
            flat[i:i + _ROW] = NEUTRAL_ROW
    return flat


@dataclass
class MLPSyncBatchInfo:
    """One rank's six sync values and, after ``all_gather``, every rank's agreed view.

    Arguments:
        dp_size, tp_size, cp_size: DP size and attention-TP / attention-CP sizes; the group holds
            ``dp·tp·cp`` ranks, DP major (rank = ``d·tp·cp + c·tp + t``).
        num_tokens, num_tokens_for_logprob: this rank's counts (≥ 0).
        can_cuda_graph, is_extend_in_batch, local_can_run_tbo: this rank's flags.
        local_forward_mode: this rank's ``ForwardMode`` (IDLE when it has no batch).

    After ``all_gather``: ``global_num_tokens`` / ``global_num_tokens_for_logprob`` (one int per
    DP rank), ``can_cuda_graph`` (min over DP ranks), ``is_extend_in_batch`` (max),
    ``can_run_tbo`` (``enable_tbo`` and every DP rank's ``local_can_run_tbo`` and all non-IDLE
    modes equal: True when every rank is idle), ``global_forward_mode`` (the common non-IDLE
    mode, IDLE when every rank is idle, None when they differ) and ``tp0_info`` (``[dp, 6]``
    int64, CPU).
    """

    dp_size: int
    tp_size: int
    cp_size: int
    num_tokens: int
    num_tokens_for_logprob: int
    can_cuda_graph: bool
    is_extend_in_batch: bool
    local_can_run_tbo: bool
    local_forward_mode: int
    global_num_tokens: list[int] | None = None
    global_num_tokens_for_logprob: list[int] | None = None
    can_run_tbo: bool | None = None
    global_forward_mode: ForwardMode | None = None
    sync: str | None = None
    _local_error: str | None = field(default=None, repr=False)
    _tp0_rows: tuple | None = field(default=None, repr=False)  # (flat rows, rank stride)

    @property
    def tp0_info(self) -> torch.Tensor | None:
        """``[dp, 6]`` int64 (CPU): each DP rank's row (its attention-TP rank 0), after
        ``all_gather``; built on first access (the per-step path does not need it)."""
        if self._tp0_rows is None:
            return None
        flat, stride = self._tp0_rows
        return torch.tensor([flat[i:i + _ROW] for i in range(0, len(flat), stride)],
                            dtype=torch.int64)

    def _local_row(self, code: int = 0) -> tuple[int, ...]:
        """This rank's row; an invalid one (``code`` or a bad value) is sent as the invalid-row
        marker so that every rank raises after the exchange."""
        err = self._local_error
        if err is None and not code:
            try:
                mode = int(self.local_forward_mode)
                num, num_lp = int(self.num_tokens), int(self.num_tokens_for_logprob)
            except (TypeError, ValueError) as exc:
                err = f"non-integer local_forward_mode or token count ({exc})"
            else:
                if mode not in _MODE_VALUES:
                    err = f"unknown local_forward_mode {self.local_forward_mode!r}"
                elif not (0 <= num <= _I64_MAX and 0 <= num_lp <= _I64_MAX):
                    err = (f"token counts must be in [0, 2**63 - 1], got num_tokens="
                           f"{self.num_tokens}, num_tokens_for_logprob="
                           f"{self.num_tokens_for_logprob}")
            self._local_error = err
        if code:
            return (code, 0, 1, 0, 1, _INVALID_MODE)
        if err is not None:
            return (_BAD_BATCH, 0, 1, 0, 1, _INVALID_MODE)
        return (num, num_lp, 1 if self.can_cuda_graph else 0, 1 if self.is_extend_in_batch else 0,
                1 if self.local_can_run_tbo else 0, mode)

    def _per_dp(self, p: SyncPlan) -> tuple[int, tuple | None]:
        """``(tp·cp, key)`` after checking the sizes against the group. ``key`` is None when the
        layout is known on the plan (agreed by every rank before: the per-step path only looks
        it up), else the ``(dp, tp, cp)`` every rank must agree on first (``_agree_layout``)."""
        key = (self.dp_size, self.tp_size, self.cp_size)
        per_dp = p.per_dp.get(key)
        if per_dp is not None:
            return per_dp, None
        dp, tp, cp = (int(v) for v in key)
        if min(dp, tp, cp) < 1 or dp * tp * cp != p.world:
            raise ValueError(f"dp_size·tp_size·cp_size = {self.dp_size}·{self.tp_size}·"
                             f"{self.cp_size} must equal the group size {p.world}")
        return tp * cp, (dp, tp, cp)

    def all_gather(self, device=None, group=None, *, active_ranks=None, enable_tbo: bool = False,
                   sync: str = "auto", timeout_s: float | None = None) -> MLPSyncBatchInfo:
        """Exchange the rows of every group rank and fill the global fields (returns ``self``).

        Arguments:
            device: the device for ``sync="device"`` (None → the group's device).
            group: the process group of ``dp·tp·cp`` ranks (None → default group).
            active_ranks: one entry per group rank (list or tensor); an inactive rank counts as
                ``[0, 0, 1, 0, 1, IDLE]`` whatever it sent (it still takes part in the exchange).
            enable_tbo: whether two-batch overlap may run at all.
            sync: "auto", "shm", "hier", "cpu" or "device" (see ``resolve_sync``; "auto" is
                "shm" on one host and "hier" on a group that spans hosts), the same on every
                rank (checked by one collective on a value's first use on the group).
            timeout_s: wait bound (None → ``ATTNCOMM_TIMEOUT_S``).

        Raises:
            ValueError (every rank, after the exchange) for sizes that do not match the group or
            an ``active_ranks`` of the wrong length on any rank, an invalid row on any active
            rank, or an explicit sync path that cannot run here; (every rank, before it) for a
            ``sync`` that is invalid or differs between ranks; the message names the ranks and
            what was wrong, and this rank's own problem in full.
            PeerTimeoutError when a rank's row does not arrive in time.
        """
        p = plan_for(resolve_group(group, "MLPSyncBatchInfo.all_gather"))
        path = resolve(p, sync, timeout_s)
        code, why = 0, None
        try:
            per_dp, new_layout = self._per_dp(p)
        except (ValueError, TypeError) as exc:  # sent as an invalid row: all raise after it
            code, why, new_layout = _BAD_SIZES, str(exc), None
        if new_layout is not None:
            _agree_layout(self, p, path, new_layout, device, timeout_s)
        active, mask = None, None
        if active_ranks is not None:  # None: the common case, every rank active
            try:
                active, mask = _active_mask(active_ranks, p.world, path)
            except (ValueError, TypeError) as exc:
                if not code:
                    code, why = _BAD_ACTIVE, str(exc)
        row = self._local_row(code)
        flat, mask_vals = rows_for(p, path, device, timeout_s).exchange(row, timeout_s, mask)
        if mask_vals is not None:
            active = [bool(v) for v in mask_vals]
        if active is not None:
            flat = _mask_rows(flat, active)
        self._validate_rows(flat, why)
        self.sync = path
        self._apply(flat, _ROW * per_dp, enable_tbo)
        return self

    def _validate_rows(self, flat: Sequence[int], why: str | None = None) -> None:
        # fast path: every mode known and no negative count (slices of the flat rows, in C)
        if _MODE_VALUES.issuperset(flat[5::_ROW]) and min(flat[0::_ROW] + flat[1::_ROW]) >= 0:
            return
        parts = []
        mine = why or self._local_error
        for r in range(len(flat) // _ROW):
            row = flat[r * _ROW:(r + 1) * _ROW]
            if row[5] in _MODE_VALUES and row[0] >= 0 and row[1] >= 0:
                continue
            if row[5] == _LAYOUT_MODE and mine:  # this rank's own invalid input is the report
                continue
            what = _WHY.get(row[0]) if row[5] == _INVALID_MODE else None
            if row[5] == _LAYOUT_MODE:
                what = (f"first use of dp_size·tp_size·cp_size = {row[0]}·{row[1]}·{row[2]} on "
                        f"this group, where this rank's layout was agreed before "
                        f"({self.dp_size}·{self.tp_size}·{self.cp_size})")
            parts.append((r, what or f"invalid row {list(row)}"))
        msg = (f"dp_attention sync: invalid input on rank(s) {[r for r, _ in parts]} — "
               + "; ".join(f"rank {r}: {w}" for r, w in parts))
        if mine:
            msg += f" (this rank: {mine})"
        raise ValueError(msg)

    def _apply(self, flat: Sequence[int], stride: int, enable_tbo: bool) -> None:
        """Fill the global fields from the rows of attention-TP rank 0 of each DP rank: field f
        of DP rank d is ``flat[d · stride + f]`` (``stride`` = 6·tp·cp), so each field's values
        are one strided slice."""
        self._tp0_rows = (flat, stride)
        self.global_num_tokens = list(flat[0::stride])
        self.global_num_tokens_for_logprob = list(flat[1::stride])
        # the flags are 0/1 (``_local_row``, NEUTRAL_ROW): min is all(), max is any()
        self.can_cuda_graph = all(flat[2::stride])
        self.is_extend_in_batch = any(flat[3::stride])
        # The global mode is the one non-IDLE mode (IDLE when every rank is idle, None when the
        # busy ranks differ). TBO needs every non-IDLE mode equal (API.md): vacuously true when
        # every rank is idle.
        modes = flat[5::stride]
        first = modes[0]
        if modes.count(first) == len(modes):  # the common case: one mode everywhere
            agree = True
            self.global_forward_mode = _MODE_OF[first]
        else:  # at least two modes, so at least one busy
            busy = set(modes)
            busy.discard(_IDLE)
            agree = len(busy) == 1
            self.global_forward_mode = _MODE_OF[busy.pop()] if agree else None
        self.can_run_tbo = bool(enable_tbo and agree and all(flat[4::stride]))


def _agree_layout(info: MLPSyncBatchInfo, p: SyncPlan, path: str, layout: tuple, device,
                  timeout_s) -> None:
    """The first use of a ``(dp, tp, cp)`` layout on a group: one exchange of layout rows on the
    sync path itself (the same buffer shape as a step, so a peer in a step exchange meanwhile
    gets a row it refuses, never a size mismatch). Raises ``ValueError`` on every rank naming
    each rank's layout when they differ (a peer in a step exchange raises it from
    ``_validate_rows``; a peer whose sizes are invalid sends its invalid row, reported as in a
    step); remembers the layout on the plan when every rank sent the same one."""
    dp, tp, cp = layout
    flat, _ = rows_for(p, path, device, timeout_s).exchange((dp, tp, cp, 0, 0, _LAYOUT_MODE),
                                                            timeout_s)
    rows = [tuple(flat[i:i + _ROW]) for i in range(0, len(flat), _ROW)]
    if all(r == rows[0] and r[5] == _LAYOUT_MODE for r in rows):
        if all(type(v) is int for v in (info.dp_size, info.tp_size, info.cp_size)):
            p.per_dp[layout] = tp * cp  # plain ints only: the cache must not grow
        return
    if any(r[5] == _INVALID_MODE for r in rows):  # as a step would report it
        info._validate_rows(sum((NEUTRAL_ROW if r[5] == _LAYOUT_MODE else r for r in rows), ()))
    parts = [f"rank {r}: " + (f"{row[0]}·{row[1]}·{row[2]}" if row[5] == _LAYOUT_MODE else
                              "a layout agreed before (it sent a step row)")
             for r, row in enumerate(rows)]
    raise ValueError("dp_attention sync: the ranks disagree on dp_size·tp_size·cp_size — "
                     + "; ".join(parts))


def _idle_batch(get_idle_batch: Callable[[], BatchView]) -> BatchView:
    """``get_idle_batch()``, checked to be an IDLE batch.

    Called only after the exchange (API.md: only then is it known that some DP rank has tokens),
    so a bad result raises ``ValueError`` on this rank alone. That cannot strand a peer inside
    this call: nothing collective follows it in ``prepare_mlp_sync_batch``, and every rank's
    sync result is already complete. It is a bug in this rank's callback; its peers meet it at
    their next collective with this rank (``PeerTimeoutError`` there if it stops).
    """
    batch = get_idle_batch()
    try:
        ok = int(batch.forward_mode) == ForwardMode.IDLE
    except (AttributeError, TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"get_idle_batch() must return an IDLE BatchView, got {batch!r}")
    return batch


def prepare_mlp_sync_batch(local_batch: BatchView | None, *, dp_size: int, attn_tp_size: int,
                           attn_cp_size: int = 1, group=None,
                           get_idle_batch: Callable[[], BatchView],
                           disable_cuda_graph: bool = False, enable_tbo: bool = False,
                           require_mlp_tp_gather: bool = True, sync: str = "auto", device=None,
                           active_ranks=None, timeout_s: float | None = None,
                           ) -> tuple[BatchView | None, MLPSyncBatchInfo]:
    """Count this rank's tokens, agree with every rank, and hand back the batch to run.

    Local values: see ``count_tokens``; ``can_cuda_graph`` = (no batch, or a DECODE / IDLE /
    PREBUILT batch) and not ``disable_cuda_graph``; ``is_extend_in_batch`` = an EXTEND/MIXED
    batch; ``local_can_run_tbo`` = ≥ 2 requests, True for a rank with no tokens.

    Returns:
        ``(batch, info)``: ``(None, info)`` on every rank when no DP rank has tokens; otherwise
        this rank's batch, where a rank without one gets ``get_idle_batch()`` and a PREBUILT
        batch gets it in ``inner_idle_batch``. With ``require_mlp_tp_gather=False`` the info's
        global lists hold only this rank's counts.

    Raises:
        ValueError on every rank when any rank's batch is invalid (the offending rank's message
        says why) or the sizes do not match the group; PeerTimeoutError as in
        ``MLPSyncBatchInfo.all_gather``. A ``get_idle_batch()`` that returns something other
        than an IDLE batch raises ValueError on the rank that called it (see ``_idle_batch``).
    """
    err = None
    try:
        num_tokens, num_lp = count_tokens(local_batch)
        mode = ForwardMode.IDLE if local_batch is None else ForwardMode(int(
            local_batch.forward_mode))
    except (ValueError, TypeError, AttributeError) as exc:  # sent as an invalid row
        err, num_tokens, num_lp, mode = str(exc) or type(exc).__name__, 0, 0, ForwardMode.IDLE
    can_graph = (local_batch is None or mode.is_decode_or_idle() or mode.is_prebuilt()) \
        and not disable_cuda_graph
    info = MLPSyncBatchInfo(dp_size, attn_tp_size, attn_cp_size, num_tokens, num_lp, can_graph,
                            local_batch is not None and mode.is_extend(),
                            _local_can_run_tbo(local_batch, num_tokens), int(mode),
                            _local_error=err)
    info.all_gather(device, group, active_ranks=active_ranks, enable_tbo=enable_tbo, sync=sync,
                    timeout_s=timeout_s)
    anyone_busy = max(info.global_num_tokens) > 0
    if not require_mlp_tp_gather:
        info.global_num_tokens = [num_tokens]
        info.global_num_tokens_for_logprob = [num_lp]
    if not anyone_busy:
        return None, info
    if local_batch is None:
        local_batch = _idle_batch(get_idle_batch)
    elif mode.is_prebuilt():
        local_batch.inner_idle_batch = _idle_batch(get_idle_batch)
    return local_batch, info
