"""``attncomm bench overhead``: the host cost of one eager call of each exchange, in units of one
``torch.add`` of the same run.

Each row times one eager call started on an idle device: synchronize, then the call on the host
(``host_us``); in other repeats, CUDA events around the call give its span on the GPU
(``gpu_us``, which includes the GPU's wait for the host when the host is the slower side).
``unit_host_us`` is one ``torch.add`` of two small tensors on the same device (machines differ
by 2× from one start to the next, so the targets are in these units). The attention rows also
time the bare ``attn_fn`` call on the whole problem (``baseline_host_us``): their target is on
the difference; a grouped forward also times the bare ``attn_fn`` once per group on that
group's share of the rank's heads (its ``group_calls_*`` fields: what the groups' own calls
cost, beside the forward's cost above them). The unit, the call and its baselines are timed
interleaved in ``--rounds`` rounds (``attncomm._timing.time_host``); the figure in units is the
median over rounds of each round's (call − baseline) ÷ unit (``_timing.paired``), so a drift
of the machine's speed during the run falls on both sides. The µs columns are medians over rounds
of each round's median. An attention call timed below its baseline is a failed measurement
(no figure, with the reason), never a cost below zero. The targets are GPU figures: rows timed
with ``--device cpu`` get no ``met``.

Rows (``--small`` shrinks them, the default on CPU): ``dcp.merge`` (T=8,
64 heads × 512, bf16, defaults), ``DcpMerger.symm_a2a`` (the object, eager), ``dcp.gather_heads``
(T=8, 64 heads × 576), ``ulysses.seq_to_head`` (``[1, 4096, 24, 128]``),
``UlyssesAttention.sequential`` / ``.pipelined_g4`` (q = k = v of that shape) and
``UlyssesAttention.graph`` (a replay of a ``torch.cuda.CUDAGraph`` of its forward, captured
after an eager warm-up, timed as the replay's own host µs, with no baseline: a replay does none
of ``attn_fn``'s host work; a capture that fails leaves its error in the row's note). At W = 1
those forwards have nothing to pack (no norm or RoPE): ``attn_fn`` reads q, k, v themselves.
``--extra`` adds ``UlyssesAttention.sequential[qk_norm+rope]`` (QK-norm and RoPE, so the fill
runs: the host work of a forward that packs, above the same bare SDPA), rows for the other
DCP/DP calls and two probes of a CUDA graph per token bucket for the merge (the replay alone,
and with the two input copies an eager caller's fresh tensors need).
Each row is built and timed in its own ``try``: a failure is the row's ``error``, the others
still run. ``--profile N`` prints the N costliest functions (cProfile, by own time) of each
row's steady-state calls: where the host time goes, on CPU (gloo) or CUDA, W=1 or more.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .._dist import cpu_group
from .._timing import paired, time_host
from ..dcp import DcpAttention, DcpMerger, DcpQueryGather, gather_heads, merge
from ..dcp.lse_merge import functional as merge_fn
from ..dcp.query_gather import functional as gather_fn
from ..dp_attention import DpPaddingMode, dp_gather, dp_reduce_scatter
from ..ulysses import UlyssesAttention, sdpa_attention, seq_to_head
from .common import (max_over_ranks, meta, print_table, run_ranks)
from .report import Report, command_options, emit

__all__ = ["OPS", "EXTRA_OPS", "TARGETS", "GPU_TARGETS", "add_arguments", "main", "run_rank",
           "markdown_table", "with_units"]

#: The rows, in the order of the host-cost targets.
OPS = ("dcp.merge", "DcpMerger.symm_a2a", "dcp.gather_heads", "ulysses.seq_to_head",
       "UlyssesAttention.sequential", "UlyssesAttention.pipelined_g4", "UlyssesAttention.graph")
#: Further rows of ``--extra``.
EXTRA_OPS = ("UlyssesAttention.sequential[qk_norm+rope]", "dcp.merge[output]",
             "DcpMerger.auto", "DcpQueryGather", "DcpAttention",
             "dp_gather", "dp_reduce_scatter", "DcpMerger.symm_a2a[graph replay]",
             "DcpMerger.symm_a2a[2 copies + graph replay]")
#: Targets in units of one torch.add, above the baseline
#: for the attention rows.
TARGETS = {"dcp.merge": 3, "DcpMerger.symm_a2a": 2, "dcp.gather_heads": 2.5,
           "ulysses.seq_to_head": 3, "UlyssesAttention.sequential": 6,
           "UlyssesAttention.pipelined_g4": 15, "UlyssesAttention.graph": 1}
#: Rows whose figure is above their baseline, the bare ``attn_fn`` (the eager forwards; a graph
#: replay does none of attn_fn's host work, so its row is the replay's own host µs).
_ATTENTION = ("UlyssesAttention.sequential", "UlyssesAttention.sequential[qk_norm+rope]",
              "UlyssesAttention.pipelined_g4", "DcpAttention")
_GRAPH_ROWS = ("UlyssesAttention.graph", "DcpMerger.symm_a2a[graph replay]",
               "DcpMerger.symm_a2a[2 copies + graph replay]")
_CUDA_ONLY = _GRAPH_ROWS + ("DcpMerger.symm_a2a",)


def _shapes(small: bool) -> dict:
    if small:
        return dict(T=4, H=8, D=16, Dq=24, R=8, S=64, UH=4, UD=16, dtype=torch.float32)
    return dict(T=8, H=64, D=512, Dq=576, R=64, S=4096, UH=24, UD=128, dtype=torch.bfloat16)


# ------------------------------------------------------------------------------ the rows
def _dcp_rows(s, device, gen, W):
    """Builders of the DCP rows: name → () → (fn, baseline fn or None, shape, note)."""

    T, H, D, Dq, dt = s["T"], s["H"], s["D"], s["Dq"], s["dtype"]
    out = torch.randn((T, H, D), generator=gen, device=device).to(dt)
    lse = torch.randn((T, H), generator=gen, device=device)
    q = torch.randn((T, H // W, Dq), generator=gen, device=device).to(dt)
    mshape, gshape = f"out [{T}, {H}, {D}] {_name(dt)}", f"q [{T}, {H // W}, {Dq}] {_name(dt)}"

    def merger(backend):
        m = DcpMerger(max_tokens=T, num_heads=H, head_dim=D, dtype=dt, backend=backend)
        return (lambda: m(out, lse)), None, mshape, f"backend {m.backend}"

    def merge_output():
        buf = torch.empty((T, H // W, D), dtype=dt, device=device)
        return (lambda: merge(out, lse, output=buf)), None, mshape, "output= given"

    def query_gather():
        g = DcpQueryGather(max_tokens=T, num_heads=H, head_dim=Dq, dtype=dt)
        return (lambda: g(q)), None, gshape, f"backend {g.backend}"

    def attention():
        def attn(q_all):
            return q_all[..., :D], q_all[..., 0].float()
        a = DcpAttention(attn, max_tokens=T, num_heads=H, head_dim=Dq, v_head_dim=D, dtype=dt)
        q_all = torch.randn((T, H, Dq), generator=gen, device=device).to(dt)
        return (lambda: a(q)), (lambda: attn(q_all)), gshape, \
            f"attn_fn: slices of the query; backends {a.backends}"

    def functional(call, shape, cache):
        call()  # the first call decides; the note names the backend it took
        return call, None, shape, "defaults: backend " + ", ".join(
            sorted({o.backend for lru in cache.values() for o in lru.values()}))

    return {
        "dcp.merge": lambda: functional(lambda: merge(out, lse), mshape, merge_fn._MERGERS),
        "DcpMerger.symm_a2a": lambda: merger("symm_a2a"),
        "dcp.gather_heads": lambda: functional(lambda: gather_heads(q), gshape,
                                               gather_fn._GATHERERS),
        "dcp.merge[output]": merge_output,
        "DcpMerger.auto": lambda: merger("auto"),
        "DcpQueryGather": query_gather,
        "DcpAttention": attention,
        "DcpMerger.symm_a2a[graph replay]": lambda: _merge_graph(s, out, lse, copies=False),
        "DcpMerger.symm_a2a[2 copies + graph replay]":
            lambda: _merge_graph(s, out, lse, copies=True),
    }


def _merge_graph(s, out, lse, copies: bool):
    """A CUDA graph of one symm_a2a merge of static inputs, replayed (after copying an eager
    caller's tensors into them, with ``copies``): what a graph per token bucket would cost."""
    m = DcpMerger(max_tokens=s["T"], num_heads=s["H"], head_dim=s["D"], dtype=s["dtype"],
                  backend="symm_a2a")
    s_out, s_lse = out.clone(), lse.clone()
    m(s_out, s_lse)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m(s_out, s_lse)

    def replay():
        if copies:
            s_out.copy_(out)
            s_lse.copy_(lse)
        graph.replay()
    return replay, None, f"out [{s['T']}, {s['H']}, {s['D']}]", "probe (not an API)"


def _ulysses_rows(s, device, gen):
    dt = s["dtype"]
    W = dist.get_world_size()
    x = torch.randn((1, s["S"] // W, s["UH"], s["UD"]), generator=gen, device=device).to(dt)
    full = torch.randn((1, s["S"], s["UH"], s["UD"]), generator=gen, device=device).to(dt)
    shape = f"x [1, {s['S'] // W}, {s['UH']}, {s['UD']}] {_name(dt)}"

    def bare():
        return sdpa_attention(full, full, full, False)

    def attention(groups):
        a = UlyssesAttention(pipeline_groups=groups)
        if groups < 2:
            return (lambda: a(x, x, x)), bare, shape, f"pipeline_groups={groups}"
        # the same attn_fn once per group on that group's share of this rank's H / W heads
        # (views made up front): what the groups' calls cost alone, beside the forward's cost
        # above them
        mine = full.narrow(2, 0, max(1, s["UH"] // W))
        slices = [h for h in mine.tensor_split(groups, 2) if h.size(2)]  # empty: no call

        def per_group():
            return [sdpa_attention(h, h, h, False) for h in slices]
        return ((lambda: a(x, x, x)), bare, shape, f"pipeline_groups={groups}", per_group)

    def normed():
        d = s["UD"]
        w = torch.randn((d,), generator=gen, device=device)
        ang = torch.randn((s["S"], d), generator=gen, device=device)
        rope = (ang.cos(), ang.sin())
        a = UlyssesAttention(pipeline_groups=0, qk_norm=(w, w, 1e-6))
        return (lambda: a(x, x, x, rope=rope)), bare, shape, \
            "pipeline_groups=0, QK-norm + RoPE in the fill (a W = 1 forward packs only then)"

    def graph():
        a = UlyssesAttention(pipeline_groups=0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                a(x, x, x)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            a(x, x, x)
        return g.replay, None, shape, "replay of a captured sequential forward"

    return {
        "ulysses.seq_to_head": lambda: ((lambda: seq_to_head(x)), None, shape, "defaults"),
        "UlyssesAttention.sequential": lambda: attention(0),
        "UlyssesAttention.sequential[qk_norm+rope]": normed,
        "UlyssesAttention.pipelined_g4": lambda: attention(4),
        "UlyssesAttention.graph": graph,
    }


def _dp_rows(s, device, gen, W):
    T, hidden, dt = s["T"], s["H"] * s["UD"], s["dtype"]
    n = [T] * W
    local = torch.randn((T, hidden), generator=gen, device=device).to(dt)
    partial = torch.randn((T * W, hidden), generator=gen, device=device).to(dt)
    shape = f"[{T}, {hidden}] {_name(dt)} per rank, MAX_LEN"
    return {
        "dp_gather": lambda: ((lambda: dp_gather(local, n, None, mode=DpPaddingMode.MAX_LEN)),
                              None, shape, ""),
        "dp_reduce_scatter": lambda: ((lambda: dp_reduce_scatter(
            partial, n, None, mode=DpPaddingMode.MAX_LEN)), None, shape, ""),
    }


def _name(dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


# ------------------------------------------------------------------------------ timing
class _Timer:
    """Host µs of calls started on an idle device, interleaved in rounds, and a call's span on
    the GPU (CUDA events)."""

    def __init__(self, device: torch.device, repeats: int, warmup: int, group, rounds: int):
        self.cuda = device.type == "cuda"
        self.repeats, self.warmup, self.group = repeats, warmup, group
        self.rounds = rounds
        self.many = dist.get_world_size() > 1

    def _idle(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        if self.many:  # ranks start each call together (the exchange waits for the slowest)
            dist.barrier(group=self.group)

    def host(self, fns: list[Callable]) -> list[list[float]]:
        """Per function, its median host µs in each round (across ranks, the slowest rank's
        time of each call): ``repeats`` calls of each, ``rounds`` rounds."""
        times = time_host(fns, repeats=self.repeats, rounds=self.rounds, warmup=self.warmup,
                          before=self._idle)
        self._idle()
        return [[statistics.median(max_over_ranks(t, self.group) if self.many else t)
                 for t in per_round] for per_round in times]

    def gpu(self, fn: Callable) -> float | None:
        if not self.cuda:
            return None
        times = []
        for _ in range(self.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._idle()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(max_over_ranks(times, self.group) if self.many else times)


def _agreed_elapsed(start: float, timer: _Timer) -> float:
    # The slowest rank's clock decides, so every rank skips the same rows.
    elapsed = time.monotonic() - start
    return max(max_over_ranks([elapsed], timer.group)) if timer.many else elapsed


def _profile(fn: Callable, calls: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def run_rank(rank: int, world_size: int, cfg: dict) -> dict:
    """Every rank builds and times every row (the exchanges are collective); rank 0's result
    (records, the unit, profiles) is the run's."""
    device = torch.device("cuda", torch.cuda.current_device()) if cfg["device"] == "cuda" \
        else torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(31 + rank)
    s = _shapes(cfg["small"])
    timer = _Timer(device, cfg["repeats"], cfg["warmup"], cpu_group(), cfg["rounds"])
    a, b = torch.randn(4, device=device), torch.randn(4, device=device)

    def add():
        return torch.add(a, b)
    unit = statistics.median(timer.host([add])[0])
    builders = {**_dcp_rows(s, device, gen, world_size), **_ulysses_rows(s, device, gen),
                **_dp_rows(s, device, gen, world_size)}
    records, profiles = {}, {}
    start = time.monotonic()
    # The target rows first; in each part, rows that capture CUDA graphs last (a capture that
    # fails cannot spoil the others).
    for op in sorted(cfg["ops"], key=lambda o: (o not in OPS, o in _GRAPH_ROWS)):
        rec = records[op] = {
            "op": op, "host_us": None, "gpu_us": None, "baseline_host_us": None,
            "unit_host_us": unit, "world_size": world_size, "shape": None, "note": None,
            "error": None, "rev": cfg["rev_label"], "seconds": None, "device": device.type}
        if op in _CUDA_ONLY and device.type != "cuda":
            rec["note"] = "CUDA only"
            continue
        if _agreed_elapsed(start, timer) > cfg["time_budget"]:
            rec["note"] = f"skipped: past the time budget of {cfg['time_budget']:g} s"
            continue
        t_row = time.monotonic()
        try:
            fn, baseline, rec["shape"], rec["note"], *per_group = builders[op]()
            rounds = timer.host([add, fn] + ([baseline] if baseline is not None else [])
                                + per_group)
            rec["unit_rounds"], rec["host_rounds"] = rounds[0], rounds[1]
            rec["unit_host_us"] = statistics.median(rounds[0])
            rec["host_us"] = statistics.median(rounds[1])
            if baseline is not None:
                rec["baseline_rounds"] = rounds[2]
                rec["baseline_host_us"] = statistics.median(rounds[2])
            if per_group:
                rec["group_calls_rounds"] = rounds[3]
                rec["group_calls_host_us"] = statistics.median(rounds[3])
            rec["gpu_us"] = timer.gpu(fn)
            if cfg["profile"]:
                profiles[op] = _profile(fn, cfg["repeats"], cfg["profile"])
        except Exception as exc:  # noqa: BLE001 - a failed row keeps its error, the rest run
            rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
            if device.type == "cuda":
                try:
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001, S110 - the next row reports its own error
                    pass
        rec["seconds"] = round(time.monotonic() - t_row, 2)
    # The run's unit: the median of the rows' own (each row is against the torch.add of its
    # rounds), or the one timed first when no row ran.
    units = [r["unit_host_us"] for r in records.values() if r.get("unit_rounds")]
    return {"records": [records[op] for op in cfg["ops"]],
            "unit_host_us": statistics.median(units) if units else unit, "profiles": profiles}


# ------------------------------------------------------------------------------ reporting
GPU_TARGETS = "targets are GPU figures (CUDA); not judged on CPU"


def _units(r: dict) -> tuple[float | None, str | None]:
    """``(units, None)``, or ``(None, why there is no figure)``."""
    unit, host = r.get("unit_host_us"), r.get("host_us")
    if r.get("error"):
        return None, "the row failed (see error)"
    if host is None:
        return None, r.get("note") or "not measured"
    if not unit or unit <= 0:
        return None, "no unit: the torch.add was not timed"
    base = r.get("baseline_host_us") if r["op"] in _ATTENTION else None
    if r["op"] in _ATTENTION and base is None:
        return None, "no baseline: the bare attn_fn was not timed"
    # Records from run_rank carry each round's medians (all three lists, or the two without a
    # baseline); a record without them is one round of its medians.
    rounds = r.get("host_rounds") is not None
    extra = paired(r["host_rounds"] if rounds else [host],
                   r["unit_rounds"] if rounds else [unit],
                   None if base is None else r["baseline_rounds"] if rounds else [base])
    if extra < 0:
        # A baseline above the call is noise larger than the figure, not a cost below zero.
        n = len(r["host_rounds"]) if rounds else 1
        return None, ("failed measurement: the call timed below its baseline"
                      + (f" in most of {n} rounds" if n > 1 else "")
                      + f" (medians {host:.1f} and {base:.1f} µs)")
    return extra, None


def _group_units(r: dict) -> tuple[float | None, float | None]:
    """A grouped forward's row (``group_calls_rounds``: the bare ``attn_fn`` once per group
    on its heads, timed in the same rounds): the groups' calls above the one bare call, and
    the forward above the groups' calls, in units; (None, None) for other rows."""
    calls = r.get("group_calls_rounds")
    if calls is None or r.get("host_rounds") is None or r.get("baseline_rounds") is None:
        return None, None
    # a figure below zero is a failed measurement (noise larger than the figure), never a cost
    below = [paired(calls, r["unit_rounds"], r["baseline_rounds"]),
             paired(r["host_rounds"], r["unit_rounds"], calls)]
    return tuple(None if u < 0 else u for u in below)


def with_units(records: list[dict]) -> list[dict]:
    """Each record with ``units`` (the median over rounds of host µs ÷ the unit timed in the
    same round; for the attention rows, of the host µs above the baseline ÷ the unit), its
    ``target_units``, whether it is ``met``, and ``why``.

    ``units`` is None when there is no figure: the row failed or was not run, or the
    measurement failed (an attention row whose call timed below its baseline in most rounds:
    never a negative figure). ``met`` is None when there is no figure or no target, and on rows
    timed on CPU (``device`` "cpu"): the targets are GPU figures. ``why`` says why ``units`` or
    ``met`` is None (None when both are set). A grouped forward's row also gets
    ``group_calls_units`` (its groups' bare ``attn_fn`` calls above the one bare call) and
    ``units_above_group_calls`` (the forward above those calls), each None below zero (a failed
    measurement) and on other rows."""
    out = []
    for r in records:
        r = dict(r)
        units, why = _units(r)
        r["units"] = units
        r["target_units"] = TARGETS.get(r["op"])
        met = None
        if units is not None and r["target_units"] is not None:
            if r.get("device") == "cpu":
                why = GPU_TARGETS
            else:
                met = units <= r["target_units"]
        r["met"] = met
        r["why"] = why
        r["group_calls_units"], r["units_above_group_calls"] = _group_units(r)
        out.append(r)
    return out


def markdown_table(records: list[dict]) -> str:
    """The rows in units of one torch.add (attention rows: above the bare ``attn_fn``)."""
    lines = ["| op | shape | host µs | units | target | GPU µs | baseline host µs | note |",
             "|---|---|---|---|---|---|---|---|"]

    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)
    for r in with_units(records):
        grouped = None if r.get("group_calls_rounds") is None else (
            f"the groups' bare attn_fn calls: {f(r['group_calls_units'], '.2f')} units above "
            f"the one call; the forward above them: {f(r['units_above_group_calls'], '.2f')}")
        note = r["error"] or "; ".join(dict.fromkeys(
            x for x in (r["note"], grouped, r["why"]) if x))
        target = "-" if r["target_units"] is None else (
            f"≤ {r['target_units']:g}" + ("" if r["met"] is None else
                                          (" ✓" if r["met"] else " ✗")))
        units = f(r["units"], ".2f") + (" above" if r["op"] in _ATTENTION and r["units"]
                                        is not None else "")
        lines.append(f"| {r['op']} | {r['shape'] or '-'} | {f(r['host_us'])} | {units} | "
                     f"{target} | {f(r['gpu_us'])} | {f(r['baseline_host_us'])} | "
                     f"{note.replace('|', '/')} |")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda (default; the measurement) or cpu (gloo ranks: host µs only, for "
                        "smoke runs and host profiles)")
    p.add_argument("--world-size", type=int, default=1, help="ranks (default 1)")
    p.add_argument("--ops", nargs="+", default=None,
                   help=f"rows to run (default: {' '.join(OPS)}; with --extra also "
                        f"{' '.join(EXTRA_OPS)})")
    p.add_argument("--extra", action="store_true", help="add the rows of the other DCP/DP "
                                                        "calls and the CUDA graph probes")
    p.add_argument("--repeats", type=int, default=200, help="timed calls per row")
    p.add_argument("--rounds", type=int, default=10,
                   help="rounds the repeats are spread over, the unit, the call and its "
                        "baseline interleaved (default 10; the figure is the median over rounds)")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls first")
    p.add_argument("--small", action="store_true",
                   help="tiny shapes (the default with --device cpu)")
    p.add_argument("--full-shapes", action="store_true",
                   help="the GPU rows' shapes with --device cpu too (a Ulysses call of "
                        "[1, 4096, 24, 128] takes over a second on a CPU: minutes per row)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print the N costliest functions of each row's calls (cProfile)")
    p.add_argument("--time-budget", type=float, default=60.0,
                   help="seconds after which the rows not yet started are skipped (default "
                        "60; the rows with a target run first)")
    p.add_argument("--rev-label", default=None, help="a label for this run's code (e.g. "
                                                     "'before' / 'after'), kept in every row")
    p.add_argument("--json", default=None, help="write the records (and meta) here")
    p.add_argument("--markdown", default=None, help="write the Markdown table here")


def _config(args) -> dict:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("bench overhead --device cuda: no CUDA device here (use --device cpu "
                         "for host µs on gloo ranks)")
    if args.world_size < 1 or args.repeats < 1 or args.rounds < 1 or args.warmup < 0:
        raise ValueError(f"--world-size, --repeats and --rounds must be ≥ 1, --warmup ≥ 0; "
                         f"got {args.world_size}, {args.repeats}, {args.rounds}, {args.warmup}")
    ops = list(args.ops or (OPS + (EXTRA_OPS if args.extra else ())))
    unknown = [o for o in ops if o not in OPS + EXTRA_OPS]
    if unknown:
        raise ValueError(f"--ops: unknown rows {unknown}; known: {list(OPS + EXTRA_OPS)}")
    small = args.small or (args.device == "cpu" and not args.full_shapes)
    return dict(device=args.device, ops=ops, repeats=args.repeats, rounds=args.rounds,
                warmup=args.warmup,
                small=small, profile=args.profile, rev_label=args.rev_label,
                time_budget=args.time_budget)


def main(args) -> int:
    """``attncomm bench overhead`` (arguments: ``add_arguments``)."""
    cfg = command_options(args, _config, "bench overhead")
    if cfg is None:
        return 2
    t0 = time.monotonic()
    res = run_ranks(run_rank, args.world_size, cfg["device"], (cfg,))[0]
    records = res["records"]
    for op, text in res["profiles"].items():
        print(f"===== host profile of {op} ({cfg['repeats']} calls, cProfile, own time)\n{text}")
    rows = with_units(records)
    print_table(rows, ["op", "host_us", "units", "target_units", "met", "gpu_us",
                       "baseline_host_us", "group_calls_units", "units_above_group_calls",
                       "why", "error"],
                title=f"host µs per eager call, W={args.world_size}, {cfg['device']}; unit = "
                      f"one torch.add timed in each row's rounds (median "
                      f"{res['unit_host_us']:.2f} µs)"
                      + (f" [{cfg['rev_label']}]" if cfg["rev_label"] else "")
                      + (f"; {GPU_TARGETS}" if cfg["device"] == "cpu" else ""))
    print(f"({time.monotonic() - t0:.1f} s)")
    m = meta(cfg["device"], args.world_size, unit_host_us=res["unit_host_us"],
             repeats=cfg["repeats"], rounds=cfg["rounds"], warmup=cfg["warmup"],
             small=cfg["small"],
             rev_label=cfg["rev_label"])
    page = (f"# Host cost per eager call — {m['date']}, {m.get('machine') or m['host']}"
            + (f" [{cfg['rev_label']}]" if cfg["rev_label"] else "") + "\n\n"
            f"W={args.world_size}, {cfg['device']} ({m.get('gpu') or 'no GPU'}); torch "
            f"{m['torch']}, Triton {m['triton']}. {cfg['repeats']} calls per row, each on an "
            f"idle device, in {cfg['rounds']} rounds with the unit and the baseline "
            f"interleaved; units: the median over rounds of each round's figure; unit = one "
            f"torch.add of the row's rounds (median over the rows {res['unit_host_us']:.2f} "
            f"µs)."
            + (f" The {GPU_TARGETS}." if cfg["device"] == "cpu" else "") + "\n\n"
            + markdown_table(records))
    emit(args, Report(meta=m, records=rows, markdown=page))
    failed = [r["op"] for r in records if r["op"] in OPS and (
        r["error"] or (r["note"] or "").startswith("skipped"))]
    if failed:
        print(f"attncomm bench overhead: rows that failed: {failed}", file=sys.stderr)
    return 1 if failed else 0
