"""What the one-GPU simulators share (``dcp_one_gpu.py``, ``dcp_gather_one_gpu.py``): W simulated
ranks of a symmetric-memory kernel on ONE GPU, their timing and their dumps.

Every simulated rank gets its own slab (all in one allocation, so peer offsets are plain pointer
differences), epoch words, error words and a stream of its own; a step launches the W ranks'
kernels on the W streams (fork/join), so they run side by side as on W GPUs, except that "peer"
stores go to this GPU's own memory instead of over NVLink. The grid bound is SMs / W, so every
program of every rank is resident (the kernels spin on each other). Figures mix in the W ranks
sharing one GPU's SMs and memory: compare kernel versions, not absolute values.

A script can drive another tree's package (``--tree PATH``: a ``git archive`` of an older
revision, ``scripts/ab_tree.py``): ``use_tree`` puts that tree first on ``sys.path`` before
anything of attncomm is imported.

Without a GPU, under ``TRITON_INTERPRET=1``, the same code runs on CPU tensors (a dry run of a
script before a device call: ``--world-size 1``, where no rank waits for another; the rank
streams, graphs and sleeps become plain calls, and the times mean nothing).
"""
from __future__ import annotations

import gc
import hashlib
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def use_tree(argv: list[str]) -> str:
    """The repository root whose ``attncomm`` this process runs: ``--tree PATH`` from ``argv``,
    else the one this script belongs to. Put first on ``sys.path`` (with its ``tests/``)."""
    root = os.path.dirname(HERE)
    if "--tree" in argv:
        root = os.path.abspath(argv[argv.index("--tree") + 1])
    sys.path[:0] = [root, os.path.join(root, "tests")]
    return root


def add_run_arguments(p, dump_help: str) -> None:
    """The options every one-GPU script takes for its runs and their A/B: ``--label``,
    ``--json``, ``--dump`` (what ``dump_help`` says), ``--tree`` (``use_tree``), ``--ab``,
    ``--rounds``, ``--out`` (``ab_tree.main``)."""
    p.add_argument("--label", default="current")
    p.add_argument("--json", default=None, help="write the records here")
    p.add_argument("--dump", default=None, help=dump_help)
    p.add_argument("--tree", default=None, help="run this tree's attncomm (a git archive)")
    p.add_argument("--ab", default=None, metavar="REV|PATH",
                   help="A/B: this tree against REV's (git archive) or an extracted tree")
    p.add_argument("--rounds", type=int, default=2, help="A/B rounds (alternating)")
    p.add_argument("--out", default=None, help="A/B: where the runs' files go")


def device() -> str:
    """``"cuda"``, or ``"cpu"`` for a dry run under the Triton interpreter; SystemExit (2)
    otherwise."""
    import torch
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    print("needs a GPU (or TRITON_INTERPRET=1 for a dry run on CPU)", file=sys.stderr)
    raise SystemExit(2)


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def sync() -> None:
    if _cuda():
        import torch
        torch.cuda.synchronize()


def graph_us(fn) -> float:
    """Median µs per call: 10 calls per CUDA graph, replays back to back (the bench helper);
    a dry run times 3 eager calls."""
    if not _cuda():
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t0) / 3 * 1e6
    from attncomm.bench.common import time_graph
    return statistics.median(time_graph(fn, per_graph=10, back_to_back=True))


def host_us(launch, n: int = 200) -> float:
    """Median host µs of ``launch()`` over ``n`` calls enqueued behind a GPU sleep (the host's
    own time, never held up by a full launch queue), garbage collection off."""
    import torch
    launch()
    sync()
    if not _cuda():
        n = 2
    else:
        torch.cuda._sleep(int(2e6) * n // 50 + int(2e7))  # longer than n launches take
    times = []
    gc.disable()
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            launch()
            times.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    sync()
    return statistics.median(times) * 1e6


class SimRanks:
    """W simulated ranks on the current GPU: ``slabs`` (one ``[total_bytes] uint8`` view each,
    4 KiB aligned), ``state`` (``[4] int32`` each), ``errors`` (``[W] int32`` each), ``streams``
    and the grid bound ``n_programs``. A subclass implements ``launch(r, loading)``
    (``loading``: with a wait budget of 1 ns, so that a rank whose peers are not running gives
    up at once)."""

    def __init__(self, W: int, total_bytes: int):
        import torch
        dev = torch.device(device())
        self.W = W
        stride = (total_bytes + 4095) // 4096 * 4096
        self.raw = torch.zeros(W * stride + 4096, dtype=torch.uint8, device=dev)
        off = (-self.raw.data_ptr()) % 4096
        self.slabs = [self.raw[off + r * stride: off + r * stride + total_bytes]
                      for r in range(W)]
        self.ptrs = [s.data_ptr() for s in self.slabs]
        self.state = [torch.zeros(4, dtype=torch.int32, device=dev) for _ in range(W)]
        self.errors = [torch.zeros(W, dtype=torch.int32, device=dev) for _ in range(W)]
        if dev.type != "cuda":  # a dry run: a few programs, no streams
            self.n_programs, self.streams = 3, None
            return
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.n_programs = max(1, sms // W)
        # The rank streams come from the high-priority pool: torch hands out pooled streams
        # round robin, so a default-priority one can be the very stream that captures a
        # graph or times it; a rank kernel on that stream would be ordered after the
        # others' forks and the spinning ranks would wait on one that cannot start.
        self.streams = [torch.cuda.Stream(priority=-1) for _ in range(W)]

    def launch(self, r: int, loading: bool = False) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Zero every slab, epoch and error word (a fresh start for every rank)."""
        sync()
        for t in (*self.state, *self.errors, self.raw):
            t.zero_()
        sync()

    def load_kernels(self) -> None:
        """Compile and load every rank's kernel alone (each gives up at once): loading a module
        while another rank's kernel spins would stall it. Then reset everything."""
        for r in range(self.W):
            self.launch(r, loading=True)
            sync()
        self.reset()

    def step(self) -> None:
        """One call on every rank, side by side on the rank streams."""
        import torch
        if self.streams is None:
            for r in range(self.W):
                self.launch(r)
            return
        main = torch.cuda.current_stream()
        if any(s == main for s in self.streams):
            raise RuntimeError("a rank stream is the launching stream: ranks would serialize")
        for r, s in enumerate(self.streams):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                self.launch(r)
        for s in self.streams:
            main.wait_stream(s)

    def timed_out(self) -> list[int]:
        """Ranks whose error words are set (after a synchronize)."""
        sync()
        return [r for r in range(self.W) if bool(self.errors[r].any())]

    def launch_host_us(self, n: int = 200) -> float:
        """Host µs per launch of rank 0's kernel (its wrapper and Triton's launch), the same
        kernel variant as the timed steps, with a 1 ns budget (its peers are not running: it
        gives up at once); then reset."""
        us = host_us(lambda: self.launch(0, loading=True), n)
        self.reset()
        return us


def digest(t) -> str:
    """SHA-256 of a tensor's bytes (a CPU copy)."""
    import torch
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy()
                          .tobytes()).hexdigest()


class Dump:
    """Outputs of a run for a bitwise comparison with another tree's run (``ab_tree``):
    ``add(key, tensor)`` keeps a CPU copy, or for more than ``FULL_BYTES`` bytes its SHA-256
    (``digest``); ``save(path)`` writes them (``torch.save``)."""

    FULL_BYTES = 1 << 20

    def __init__(self):
        self.tensors = {}

    def add(self, key: str, t) -> None:
        t = t.detach().contiguous()
        if t.numel() * t.element_size() > self.FULL_BYTES:
            self.tensors[key] = f"sha256 {digest(t)} {t.dtype} {list(t.shape)}"
        else:
            self.tensors[key] = t.cpu().clone()

    def save(self, path: str | None) -> None:
        if path:
            import torch
            torch.save(self.tensors, path)
