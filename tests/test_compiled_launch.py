"""``attncomm.compiled_launch.LaunchCache``: the first launch of a key goes through the wrapper and
Triton's JIT; later ones through the compiled kernel's launcher with the call's tensors, and
only when that is safe. Runs on CPU with stand-ins for Triton's JIT function and compiled kernel
(the real ones need a GPU: the GPU tests launch through it)."""
from __future__ import annotations

import pytest

from attncomm import compiled_launch
from attncomm.compiled_launch import LaunchCache, aligned, alignment_key


class _Device:
    index = 0


class _Tensor:
    """What the cache reads of a tensor: ``is_cuda``, ``device``, ``data_ptr()``."""

    is_cuda = True
    device = _Device()

    def __init__(self, ptr):
        self.ptr = ptr

    def data_ptr(self):
        return self.ptr


class _Param:
    def __init__(self, name, default=None, has_default=False):
        self.name, self.default, self.has_default = name, default, has_default


class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.calls = []

    @property
    def run(self):
        return lambda *a: self.calls.append(a)


class _Jit:
    """Triton's ``JITFunction`` as a wrapper sees it: ``kernel[grid](*args, **kw)`` calls
    ``kernel.run(*args, grid=..., warmup=False, **kw)``, which returns the compiled kernel."""

    def __init__(self, names, defaults=None):
        defaults = defaults or {}
        self.params = [_Param(n, defaults.get(n), n in defaults) for n in names]
        self.compiled, self.jit_launches = _Compiled(), []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)

    def run(self, *args, grid, warmup, **kwargs):
        self.jit_launches.append((grid, args, kwargs))
        return self.compiled


@pytest.fixture(autouse=True)
def _stream(monkeypatch):
    monkeypatch.setattr(compiled_launch, "_current_stream", lambda index: 1234)


def _wrapper(kernel, dyn, fixed, grid=(3,), extra_launch=None):
    def launch():
        kernel[grid](*dyn, fixed, N=7, BLOCK=16, num_warps=4)
        if extra_launch is not None:
            extra_launch[(1,)](*dyn, fixed, N=1, BLOCK=1)
    return launch


def test_replays_through_the_compiled_kernel_with_the_calls_tensors():
    k = _Jit(["a", "b", "slab", "N", "BLOCK"])
    cache = LaunchCache([k])
    a0, b0, slab = _Tensor(0), _Tensor(16), object()
    cache.launch("key", _wrapper(k, (a0, b0), slab), (a0, b0))
    assert len(k.jit_launches) == 1 and cache.replayable("key")
    assert "run" not in k.__dict__  # the recorder is gone after the wrapper
    a1, b1 = _Tensor(32), _Tensor(48)
    cache.launch("key", _wrapper(k, (a1, b1), slab), (a1, b1))
    assert len(k.jit_launches) == 1  # no second JIT launch
    (call,) = k.compiled.calls
    # CUDA tensors go as their addresses, anything else as it is
    assert call == (3, 1, 1, 1234, "function", "metadata", None, None, None, 32, 48, slab, 7, 16)


def test_replays_pass_cuda_tensors_as_addresses_and_others_as_they_are():
    """The launcher gets the address of each CUDA tensor, the call's and the fixed ones (read
    at each launch: a fixed tensor's storage may move); a tensor that is not on CUDA reaches
    the launcher as the tensor, which Triton's launcher refuses."""
    k = _Jit(["a", "b", "slab", "N", "BLOCK"])
    cache = LaunchCache([k])
    a0, b0, slab = _Tensor(0), _Tensor(16), _Tensor(64)
    cache.launch("key", _wrapper(k, (a0, b0), slab), (a0, b0))
    slab.ptr = 128
    a1, cpu = _Tensor(32), _Tensor(48)
    cpu.is_cuda = False
    cache.launch("key", _wrapper(k, (a1, cpu), slab), (a1, cpu))
    (call,) = k.compiled.calls
    assert call[9:] == (32, cpu, 128, 7, 16)


def test_a_new_key_goes_through_the_wrapper():
    k = _Jit(["a", "slab", "N", "BLOCK"])
    cache = LaunchCache([k])
    t = _Tensor(0)
    for key in ("k1", "k2", "k1"):
        cache.launch(key, _wrapper(k, (t,), None), (t,))
    assert len(k.jit_launches) == 2 and len(k.compiled.calls) == 1


@pytest.mark.parametrize("case", ["derived tensor", "two launches", "missing parameter",
                                  "interpreter", "launch hook"])
def test_unsafe_replays_launch_through_the_wrapper_every_time(case, monkeypatch):
    k = _Jit(["a", "slab", "N", "BLOCK", "MISSING"] if case == "missing parameter"
             else ["a", "slab", "N", "BLOCK"])
    other = _Jit(["a", "slab", "N", "BLOCK"])
    cache = LaunchCache([k, other])
    t = _Tensor(0)
    launch = _wrapper(k, (t,), None, extra_launch=other if case == "two launches" else None)
    if case == "derived tensor":  # the wrapper passes another object than the call's tensor
        launch = _wrapper(k, (_Tensor(0),), None)
    if case == "interpreter":
        t.is_cuda = False
    if case == "launch hook":
        knobs = pytest.importorskip("triton").knobs
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    for _ in range(3):
        cache.launch("key", launch, (t,))
    assert len(k.jit_launches) == 3 and not k.compiled.calls
    # a hook installed after recording: the handle stays, the launches go through the JIT
    assert cache.replayable("key") == (case == "launch hook")


def test_a_key_without_a_launch_launches_nothing():
    k = _Jit(["a"])
    cache = LaunchCache([k])
    t = _Tensor(0)
    cache.launch("empty", lambda: None, (t,))
    cache.launch("empty", lambda: pytest.fail("the wrapper ran again"), (t,))
    assert not k.jit_launches and not k.compiled.calls


def test_defaults_fill_parameters_the_wrapper_left_out():
    k = _Jit(["a", "slab", "N", "BLOCK", "EXTRA"], defaults={"EXTRA": 5})
    cache = LaunchCache([k])
    t = _Tensor(0)
    for _ in range(2):
        cache.launch("key", _wrapper(k, (t,), None), (t,))
    assert k.compiled.calls[0][-1] == 5


def test_alignment_key():
    assert alignment_key([_Tensor(0), _Tensor(8), _Tensor(32)]) == (True, False, True)
    assert aligned((0, 8, 32, 48, 4)) == (True, False, True, True, False)


def test_hooked_reads_triton_hook_chains():
    """Triton 3.6 keeps launch hooks in chains: an empty chain is no hook (the fill's and the
    symm kernels' direct launches stay on), a chain with a call or a bare callable is one."""
    pytest.importorskip("triton")
    from triton import knobs
    assert not compiled_launch.hooked()  # nothing installed in the test process
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "calls"):
        chain.calls.append(lambda *a: None)
        try:
            assert compiled_launch.hooked()
        finally:
            chain.calls.pop()
    assert not compiled_launch.hooked()


def test_replay_launches_a_recorded_key_with_the_given_addresses(monkeypatch):
    """``replay(key, addresses)`` launches a recorded key's compiled kernel with the addresses
    as they are; it declines (False, nothing launched) for a key not recorded, with replay
    off, or with a launch hook installed, and a recorded empty call launches nothing."""
    k = _Jit(["a", "b", "slab", "N", "BLOCK"])
    cache = LaunchCache([k])
    a0, b0 = _Tensor(0), _Tensor(16)
    assert not cache.replay("key", (0, 16))
    cache.launch("key", _wrapper(k, (a0, b0), None), (a0, b0))
    assert cache.replay("key", (96, 112))
    assert k.compiled.calls == [(3, 1, 1, 1234, "function", "metadata", None, None, None,
                                 96, 112, None, 7, 16)]
    monkeypatch.setattr(compiled_launch, "REPLAY", False)
    assert not cache.replay("key", (96, 112))
    monkeypatch.setattr(compiled_launch, "REPLAY", True)
    monkeypatch.setattr(compiled_launch, "hooked", lambda: True)
    assert not cache.replay("key", (96, 112))
    monkeypatch.setattr(compiled_launch, "hooked", lambda: False)
    cache.launch("empty", lambda: None, (a0,))
    assert cache.replay("empty", (0,)) and len(k.compiled.calls) == 1
