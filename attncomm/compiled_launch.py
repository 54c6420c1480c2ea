"""Launching a wrapper's Triton kernel again through the kernel Triton compiled for it.

Triton's JIT spends most of a launch's host time before the launch itself: binding the
arguments, specializing each one, building the cache key, checking its options. For a launch
whose every argument but a few tensors is fixed (the symmetric-memory merge and gather: the
layout, the descriptor, the slab and the block plan are fixed per token count), that work gives
the same answer every time. ``LaunchCache`` lets the wrapper (``launch_merge``,
``launch_gather``) launch the first time a key is seen, through the JIT, records the compiled
kernel and the arguments the wrapper passed, and launches later calls with the same key through
the compiled kernel's launcher, with the call's tensors in place of the recorded ones: the same
kernel, the same bits, the JIT's per-launch work left out (the Ulysses fill and the DCP merge
launch this way too, through ``replay`` with the addresses they read for their own per-call
key).

The caller's key must fix everything the wrapper derives from the call besides the changing
tensors' addresses (the token count) and what Triton specializes those tensors on (each one's
16-byte alignment; their dtypes are fixed by the caller's object). Launches are replayed only
when it is safe to: the wrapper launched exactly one kernel, its leading positional arguments
were exactly the changing tensors, every other parameter was given, no launch hook (a
profiler's) is installed at the call, and the kernel is a compiled one (not Triton's
interpreter, which CPU tests run). Anything else launches through the wrapper every time.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

__all__ = ["LaunchCache", "alignment_key", "aligned", "hooked", "capturing", "REPLAY",
           "check_block"]

_MAX_KEYS = 1024
#: Replay recorded launches (False: every launch through the wrapper and Triton's JIT, for an
#: A/B of the host cost or the bits).
REPLAY = True


def check_block(owner: str, name: str, value) -> None:
    """``ValueError`` (``"<owner>: <name> must be None or a power of two ≥ 1"``) unless a
    kernel's launch-shape argument ``value`` is None (its default) or a power of two (an int,
    not a bool): Triton's block sizes and warp counts are powers of two."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1 or value & (value - 1)):
        raise ValueError(f"{owner}: {name} must be None or a power of two ≥ 1, got {value!r}")


def alignment_key(tensors: Sequence[torch.Tensor]) -> tuple:
    """Whether each tensor's address is 16-byte aligned (what Triton specializes pointers on)."""
    return aligned([t.data_ptr() for t in tensors])


def aligned(addresses: Sequence[int]) -> tuple:
    """``alignment_key`` of addresses already read (for ``LaunchCache.replay``'s callers)."""
    return tuple([p % 16 == 0 for p in addresses])


class _Recorder:
    """While the wrapper runs: every launch of the watched kernels, with its compiled kernel."""

    def __init__(self, kernels):
        self.kernels, self.launches = kernels, []

    def __enter__(self):
        for k in self.kernels:
            # ``kernel[grid](...)`` calls ``kernel.run(...)``: an instance attribute shadows
            # the method for this one wrapper call.
            k.run = self._wrap(k)
        return self

    def _wrap(self, k):
        real = type(k).run

        def run(*args, grid, warmup, **kwargs):
            compiled = real(k, *args, grid=grid, warmup=warmup, **kwargs)
            self.launches.append((k, grid, args, kwargs, compiled))
            return compiled
        return run

    def __exit__(self, *exc):
        for k in self.kernels:
            k.__dict__.pop("run", None)


class _Handle:
    """One recorded launch: the compiled kernel's launcher and its fixed arguments.

    CUDA tensors reach the launcher as their addresses: handed a tensor, Triton's launcher asks
    the driver to check its address (``cuPointerGetAttribute``) on every launch, a driver call
    per pointer argument; the recording launch through the JIT checked tensors of these kinds
    already. Anything else (a CPU tensor passed by mistake) goes as it is, for the launcher to
    refuse as it would through the JIT."""

    __slots__ = ("run", "function", "meta", "grid", "tail", "device", "tensors")

    def __init__(self, compiled, grid, tail, device):
        self.run = compiled.run  # loads the binary on first access
        self.function, self.meta = compiled.function, compiled.packed_metadata
        self.grid, self.tail, self.device = (tuple(grid) + (1, 1))[:3], tail, device
        # the fixed arguments that are CUDA tensors: their addresses are read per launch
        self.tensors = tuple(i for i, a in enumerate(tail) if getattr(a, "is_cuda", False))

    def __call__(self, values) -> None:
        """Launch with ``values``: the changing arguments as the launcher takes them (a CUDA
        tensor's address, anything else as it is)."""
        stream = _current_stream(self.device)
        tail = self.tail
        if self.tensors:
            tail = list(tail)
            for i in self.tensors:
                tail[i] = tail[i].data_ptr()
        self.run(*self.grid, stream, self.function, self.meta, None, None, None, *values,
                 *tail)


def capturing(x) -> bool:
    """Whether ``x`` (a tensor or a device) is on CUDA and the current stream is capturing a
    CUDA graph (a launch then is recorded, not run: no host-to-device copy may go with it)."""
    cuda = x.is_cuda if isinstance(x, torch.Tensor) else torch.device(x).type == "cuda"
    return cuda and torch.cuda.is_current_stream_capturing()


def hooked() -> bool:
    """Whether a launch hook (a profiler's) is installed: launches then go through the JIT,
    which calls it. Triton 3.6 keeps the hooks in chains (empty: none), older ones as None."""
    rt = _runtime_knobs()
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return (enter is not None and bool(getattr(enter, "calls", True))) or \
        (leave is not None and bool(getattr(leave, "calls", True)))


@functools.cache
def _runtime_knobs():
    from triton import knobs  # optional: only reached once a kernel was recorded
    return knobs.runtime


def _current_stream(device_index: int) -> int:
    """The current CUDA stream of the device, as the launcher takes it."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def _no_launch(values) -> None:
    return None


class LaunchCache:
    """Per key, how the wrapper launched its kernel, replayed through the compiled kernel.

    Arguments:
        kernels: the ``triton.jit`` functions the wrapper may launch (one per call).
    """

    def __init__(self, kernels: Sequence):
        self.kernels = tuple(k for k in kernels if k is not None)
        self._handles: dict = {}

    def launch(self, key, wrapper: Callable[[], None], dynamic: Sequence[torch.Tensor]) -> None:
        """Launch: through ``wrapper()`` the first time ``key`` is seen (recording it), else
        through the recorded handle with ``dynamic`` (the call's changing tensors, in the order
        of the kernel's leading parameters) in place of the recorded ones."""
        handle = self._handles.get(key)
        if handle is not None and REPLAY and not hooked():
            handle([t.data_ptr() if t.is_cuda else t for t in dynamic])
            return
        if key in self._handles or not REPLAY or not dynamic[0].is_cuda or not self.kernels:
            wrapper()
            return
        with _Recorder(self.kernels) as rec:
            wrapper()
        if len(self._handles) >= _MAX_KEYS:
            self._handles.clear()
        self._handles[key] = self._handle(rec.launches, dynamic)

    def _handle(self, launches, dynamic):
        """The replay of ``launches`` (None: replay is not safe, the wrapper launches)."""
        if not launches:
            return _no_launch  # nothing to launch for this key (an empty call)
        if len(launches) > 1:
            return None
        k, grid, args, kwargs, compiled = launches[0]
        n = len(dynamic)
        if compiled is None or len(args) < n or any(a is not d for a, d in zip(args, dynamic)):
            return None
        try:
            tail = list(args[n:])
            for p in k.params[len(args):]:
                if p.name in kwargs:
                    tail.append(kwargs[p.name])
                elif p.has_default:
                    tail.append(p.default)
                else:
                    return None
            return _Handle(compiled, grid, tuple(tail), dynamic[0].device.index)
        except Exception:  # noqa: BLE001 - a Triton without these attributes: the JIT path
            return None

    def replay(self, key, addresses: Sequence[int]) -> bool:
        """Launch through the recorded handle of ``key`` with ``addresses`` (the call's
        changing tensors, all on CUDA, as their ``data_ptr()``, in ``launch``'s ``dynamic``
        order): True when it launched; False when ``launch`` must (``key`` not recorded or not
        replayable, replay off, a launch hook installed). For a caller that reads the
        addresses anyway (for its own key) and so passes them instead of the tensors."""
        handle = self._handles.get(key)
        if handle is None or not REPLAY or hooked():
            return False
        handle(addresses)
        return True

    def replayable(self, key) -> bool:
        """Whether calls with ``key`` go through a recorded handle (for tests and benches)."""
        return self._handles.get(key) is not None
