"""What DCP's two exchanges, the merge (``lse_merge/``) and the query gather (``query_gather/``),
share: the registry of an exchange's backends, the base of those backends (and of the
symmetric-memory ones), the base of the preallocated objects (``DcpMerger``,
``DcpQueryGather``), and the functional calls' per-group cache of those objects.

Dependency direction: each exchange's interface module (``backend.py``) makes its ``Registry``
and subclasses ``ExchangeBackend``; its backends register there; its facade (``api.py``) builds
its object on ``PreallocatedExchange``, and its functional call (``functional.py``) keeps the
objects it builds in an ``ObjectCache``. This module imports no exchange.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import _triton, capability, config, select
from .._dist import Lifecycle, as_device, group_device, group_key, on_release, resolve_group
from .._agree import agree, agreed_min
from .._plans import Cached, register
from ..compiled_launch import LaunchCache
from ..symm import SymmWorkspace, grid_bound
from ..symm_regions import Slab
from . import tracing

__all__ = ["Registry", "ExchangeBackend", "SymmBackend", "PreallocatedExchange", "ObjectCache",
           "DTYPES", "geometry_error", "token_bucket"]

#: The dtypes every DCP exchange takes.
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Signatures an exchange object remembers as checked (it forgets them all past this many).
_ACCEPTED_SIZE = 4096


class Registry:
    """The backends of one exchange: their classes by name, filled by ``register`` when a
    backend's module is imported, and what ``"auto"`` takes among them (``select.resolve``).

    Arguments:
        names: every backend name, then ``"auto"`` (not a backend: the exchange's object
            resolves it), in the order messages list them.
        label: how messages name a backend (``"DCP backend"``).
        declared_in: the name of the tuple a new backend name is declared in.
        preferred: the fast single-host backend whose absence ``fallback_reason`` explains.
        rule_of_thumb: the order ``auto`` takes when nothing is measured.
        auto_names: the candidates ``auto`` considers (None: every backend).
        env_var: the ``config`` variable naming a preferred backend for ``auto``.
    """

    def __init__(self, names: tuple[str, ...], label: str, declared_in: str, *, preferred: str,
                 rule_of_thumb: tuple[str, ...], env_var: str,
                 auto_names: tuple[str, ...] | None = None):
        self.names, self.label, self.declared_in = tuple(names), label, declared_in
        self.preferred, self.rule_of_thumb = preferred, rule_of_thumb
        self.auto_names, self.env_var = auto_names, env_var
        #: name → class.
        self.classes: dict[str, type] = {}

    def register(self, cls: type) -> type:
        """Class decorator: register a backend under its ``name`` (one of ``names``, not auto).

        Raises:
            ValueError: the name is not declared.
        """
        if cls.name not in self.names[:-1]:
            raise ValueError(f"unknown {self.label} name {cls.name!r}; declare it in "
                             f"{self.declared_in}")
        self.classes[cls.name] = cls
        return cls

    def backend_class(self, name: str) -> type:
        """The class registered as ``name``.

        Raises:
            ValueError: ``name`` is not a backend, or its module was not imported (the facade
            imports every backend module).
        """
        if name not in self.classes:
            raise ValueError(f"unknown {self.label} {name!r}; expected one of "
                             f"{list(self.names[:-1])}")
        return self.classes[name]

    def name_error(self, backend) -> str | None:
        """Why ``backend`` is not a name a caller may pass (``"auto"`` included), or None."""
        if backend not in self.names:
            return f"backend={backend!r} is not one of {list(self.names)}"
        return None

    def code(self, backend) -> int:
        """``backend``'s index in ``names`` (-1: not one), as argument checks agree it."""
        return self.names.index(backend) if backend in self.names else -1


def geometry_error(max_tokens, num_heads, head_dim, dtype, world_size: int) -> str | None:
    """Why an exchange object cannot take this geometry (None if it can): ``max_tokens``,
    ``num_heads`` and ``head_dim`` ints ≥ 1 (not bools), ``dtype`` fp16/bf16/fp32, ``num_heads``
    divisible by ``world_size``."""
    for label, v in (("max_tokens", max_tokens), ("num_heads", num_heads),
                     ("head_dim", head_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return f"{label} must be an int ≥ 1, got {v!r}"
    if dtype not in DTYPES:
        return f"dtype must be fp16/bf16/fp32, got {dtype}"
    if num_heads % world_size:
        return f"num_heads={num_heads} is not divisible by world size W={world_size}"
    return None


class ExchangeBackend(ABC):
    """What every backend of a DCP exchange holds and answers (each exchange's interface
    subclasses it with its call: ``lse_merge.backend.DcpBackend``,
    ``query_gather.backend.QueryGatherBackend``).

    Constructed collectively (every rank of ``group``, same arguments) for calls of up to
    ``max_tokens`` tokens of ``num_heads`` heads (``hs = num_heads / W`` per rank) of
    ``head_dim`` elements in ``dtype`` on ``device``; ``timeout_s``: the wait budget.
    """

    name: str = "?"

    def __init__(self, group, *, max_tokens: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, timeout_s: float):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.max_tokens, self.num_heads, self.head_dim = max_tokens, num_heads, head_dim
        self.hs = num_heads // self.world_size
        self.dtype, self.device, self.timeout_s = dtype, device, timeout_s

    @classmethod
    def collective_unavailable_reason(cls, group, device: torch.device) -> str | None:
        """Why this backend cannot run on this rank (None if it can). A collective call: every
        rank of ``group`` calls it alike (it may learn which hosts the peers are on); the caller
        agrees the verdict across ranks (``attncomm.select``)."""
        return None

    @abstractmethod
    def __call__(self, *args, **kwargs):
        """One exchange (each interface gives its arguments and result)."""

    def check(self) -> None:
        """Raise any timeout recorded on the device since the last check (default: none)."""

    def close(self) -> None:
        """Free what the backend holds (collective when it holds symmetric memory: a barrier
        first, so no peer still writes into it). Default: nothing to free."""


class SymmBackend:
    """What a symmetric-memory backend adds to its exchange's ``ExchangeBackend`` (listed
    first among its bases): the eligibility probe, the slab and its workspace, ``check`` and
    ``close``.

    A subclass sets ``label`` (how messages name it) and ``kernels`` (its Triton kernel module,
    None where Triton does not import), calls ``_require_kernels()`` first in its constructor
    and ``_map_slab`` once it knows its layout.
    """

    label: str = "symm"
    kernels = None

    @classmethod
    def collective_unavailable_reason(cls, group, device: torch.device) -> str | None:
        reason = capability.symm_unavailable_reason(group, device)  # collective: always call
        if reason is None and cls.kernels is None:
            return _triton.REASON
        return reason

    def _require_kernels(self) -> None:
        if self.kernels is None:
            raise RuntimeError(f"{self.label} needs Triton: {_triton.REASON}")

    def _map_slab(self, layout, op: str, kernels: tuple, *bound) -> None:
        """Map ``layout``'s slab on every rank (collective, host-blocking: allocation, then
        rendezvous, each agreed across ranks). Sets ``layout``, ``timeout_ns``, ``ws`` (the
        ``SymmWorkspace``, named ``op`` in its errors), ``slab`` (this rank's ``Slab``),
        ``n_programs_max`` (``grid_bound(device, *bound)`` agreed across ranks: block plans
        must match everywhere) and ``_launches`` (a ``LaunchCache`` of ``kernels``).

        Raises:
            RuntimeError: the slab is too large for the kernels' 32-bit offsets.
        """
        if layout.total_bytes >= 2 ** 31:
            raise RuntimeError(f"{self.label}: slab of {layout.total_bytes} bytes exceeds the "
                               f"kernel's 32-bit offsets; lower max_tokens")
        self.layout = layout
        self.timeout_ns = int(self.timeout_s * 1e9)
        self.ws = ws = SymmWorkspace.agreed(self.group, layout, self.device, op=op,
                                            timeout_s=self.timeout_s)
        self.slab = Slab.build(layout, ws.slab, ws.peer_ptrs, self.rank, ws.state, ws.errors,
                               self.timeout_ns)
        self.n_programs_max = agreed_min(self.group, grid_bound(self.device, *bound))
        self._launches = LaunchCache(kernels)

    def check(self) -> None:
        """Raise ``PeerTimeoutError`` for a wait that timed out since the last check (reads
        the error word; no CUDA call)."""
        self.ws.check()

    def close(self) -> None:
        """Collective: free the slab once every rank got here (``SymmWorkspace.close``)."""
        self.ws.close()


class PreallocatedExchange(Lifecycle):
    """The base of an exchange's preallocated object: it opens on a group, agrees its
    arguments, resolves its backend (``attncomm.select``: eagerly, before any capture), checks
    calls locally once per signature, and forwards ``check`` and ``close`` to the backend.

    A subclass sets ``op`` (its name in messages) and ``registry`` (its backends), and gives
    ``_timing_inputs(impl, num_tokens, gen)`` (the arguments of a timed call, drawn from
    ``gen``), ``local_error(*args)`` (why this rank cannot make a call, or None) and, when its
    backends take more than ``ExchangeBackend``'s arguments, ``_kwargs()``. Its constructor
    calls ``_open``, ``_agree`` and, with its attributes set, ``_resolve``.
    """

    op: str = "?"
    registry: Registry

    def _open(self, group, device, timeout_s) -> None:
        # Every rank alike, before any check: the group, the device, the wait budget.
        self.group = group = resolve_group(group, self.op)
        self.device = group_device(group) if device is None else as_device(device)
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout_s = config.timeout_s(timeout_s)

    def _agree(self, sig: list, labels: list, err: str | None, agreed: bool = False) -> None:
        # The constructor's arguments (one int per label) and whether the device is CUDA,
        # agreed: ValueError on every rank when one rank has ``err`` or the ranks differ.
        # ``agreed``: built by a functional call whose argument check
        # (``_agree.validate_args``) agreed the arguments these derive from, the device
        # included, in this call: not agreed a second time (``err`` then raises here).
        if agreed:
            if err:
                raise ValueError(f"{self.op}: invalid arguments — rank {self.rank}: {err}")
            return
        agree(self.group, self.op, sig + [int(self.device.type == "cuda")],
              labels + ["device is CUDA"], err, self.timeout_s)

    def _resolve(self, requested: str) -> None:
        """Choose and build the backend (collective); sets ``requested_backend``,
        ``decision``, ``fallback_reason``, ``backend`` and ``op_name``."""
        self.requested_backend = requested
        unmeasured = capability.unmeasured_reason(self.group, self.device)  # collective on CUDA
        reg = self.registry
        self.decision, self._impl = select.resolve(
            self.group, op=self.op, requested=requested, names=reg.names[:-1],
            preferred=reg.preferred, rule_of_thumb=reg.rule_of_thumb, auto_names=reg.auto_names,
            local_reason=self._local_reason,
            build=lambda name: reg.backend_class(name)(self.group, **self._kwargs()),
            measured=unmeasured is None, rule=unmeasured,
            cases=select.token_buckets(self.max_tokens), prepare=self._timing_case,
            env_var=reg.env_var)
        self.fallback_reason: str | None = self.decision.fallback_reason
        self.backend = self._impl.name
        self._accepted: set = set()
        #: The name a compiled graph's custom op finds this object by (``_plans.register``).
        self.op_name = register(self)

    def _kwargs(self) -> dict:
        return dict(max_tokens=self.max_tokens, num_heads=self.num_heads,
                    head_dim=self.head_dim, dtype=self.dtype, device=self.device,
                    timeout_s=self.timeout_s)

    def _local_reason(self, name: str) -> str | None:
        # Collective (a symm backend learns where its peers are): every rank calls it for every
        # name.
        try:
            cls = self.registry.backend_class(name)
        except ImportError as exc:
            return f"{name} is not available: {exc}"
        return cls.collective_unavailable_reason(self.group, self.device)

    def _timing_case(self, impl, num_tokens: int):
        gen = torch.Generator(device=self.device).manual_seed(self.rank)
        args = self._timing_inputs(impl, num_tokens, gen)
        return lambda: impl(*args)

    def _accept(self, key, *args) -> None:
        # A call's local checks, once per signature ``key`` (None: not hashable, checked).
        if key is not None and key in self._accepted:
            return
        err = self.local_error(*args)
        if err:
            raise ValueError(f"{self.op}: {err}")
        if len(self._accepted) >= _ACCEPTED_SIZE:
            self._accepted.clear()
        self._accepted.add(key)

    def check(self) -> None:
        """Raise ``PeerTimeoutError`` for any timeout the device recorded since the last check."""
        self._impl.check()

    def _release(self) -> None:
        self._impl.close()


def token_bucket(num_tokens: int) -> int:
    """The token bucket a functional call of ``num_tokens`` (≥ 1) tokens runs in: the next power
    of two, at least 16 (one object per geometry and bucket)."""
    return max(16, 1 << (num_tokens - 1).bit_length())


class ObjectCache:
    """The preallocated objects a functional call (``dcp.merge``, ``dcp.gather_heads``) built:
    per group an LRU of ``size`` (``_dist.group_lru_get``: the least recently used is closed
    first, on every rank alike), keyed by ``(token bucket, *geometry)``.
    ``attncomm.release(group)`` closes a group's objects.
    """

    def __init__(self, size: int):
        self.size = size
        #: ``group_key`` → its LRU (key → object).
        self.store: dict = {}
        on_release(self.release)

    def release(self, key) -> None:
        """Close the objects of the group whose ``group_key`` is ``key``."""
        for obj in self.store.pop(key, {}).values():
            obj.close()

    def cached(self, group, num_tokens: int, geometry: tuple,
               build: Callable[[int, bool], object], capture_error: Callable[[], Exception],
               agreed: bool = False) -> Cached:
        """The object for ``num_tokens`` tokens of ``geometry`` on ``group``, as a plan holds
        it (``_plans.Cached``): ``build(max_tokens, agreed)`` makes it, for the token bucket,
        when the LRU lacks it; ``capture_error()`` is raised when that happens during a graph
        capture. ``agreed``: the calling check agreed the call's arguments just now
        (``validate_args`` returned True), so an object built at once gets ``agreed=True`` and
        does not agree them again; one built later (after an eviction) gets False: its
        construction is then the first bounded wait of that call."""
        key = (token_bucket(num_tokens), *geometry)
        fresh = [agreed]

        def make():
            skip, fresh[0] = fresh[0], False
            return build(key[0], skip)

        cached = Cached(self.store, group, key, make, self.size, capture_error)
        fresh[0] = False  # built now or found: a later build agrees again
        return cached

    def warm(self, group, num_tokens, geometry: tuple) -> bool:
        """Whether a call of ``num_tokens`` tokens of ``geometry`` finds an object an eager call
        built on ``group`` (``tracing.ANY`` anywhere, a symbolic dim while tracing, matches
        any); a call of no tokens needs none."""
        if num_tokens == 0:
            return True
        pattern = (num_tokens if num_tokens is tracing.ANY else token_bucket(num_tokens),
                   *geometry)
        return any(tracing.matches(key, pattern) for key in self.store.get(group_key(group), {}))
