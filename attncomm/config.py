"""Every ``ATTNCOMM_*`` environment variable, in one typed table, and the safety settings.

No other module reads an ``ATTNCOMM_*`` variable from ``os.environ``: they call ``get`` (the
typed value, checked) or ``raw`` (the text, for a caller that checks it itself), or one of the
helpers below. Each row says whether the variable is public (documented in README.md, kept
across versions) and when it is read: ``"call"`` (on every use, so a change applies at once) or
``"once"`` (when its module is imported; the value holds for the process).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

__all__ = ["Var", "VARS", "get", "raw", "overrides", "set_var", "setting", "timeout_s",
           "validate_enabled", "validation_mode", "env_backend", "default_safe_env",
           "force_safe_env", "SAFE_ENV", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Var:
    """One environment variable: its ``type`` (int, float, bool or str), the ``default`` when it
    is unset or empty, whether it is ``public``, when it is ``read`` ("call": by every call
    that depends on it; "plan": when a call plan or forward plan is made, so a change takes
    effect at the next new plan or, for every signature, after ``attncomm.release(group)``;
    "once": once per process by the module that uses it), allowed
    ``choices`` (str variables; None: any), the smallest allowed value ``minimum`` (numbers), and
    what it does (``doc``)."""

    name: str
    type: type
    default: object
    public: bool
    read: str
    doc: str
    choices: tuple[str, ...] | None = None
    minimum: float | None = None


_TABLE = (
    # Public.
    Var("ATTNCOMM_TIMEOUT_S", float, DEFAULT_TIMEOUT_S, True, "call",
        "Seconds every wait on a peer may take before PeerTimeoutError (process groups, "
        "device waits, argument checks); must be > 0. The Ulysses calls and UlyssesAttention "
        "read it when they make a plan (a change takes effect at the next new plan or after "
        "attncomm.release(group)); the other calls on every call."),
    Var("ATTNCOMM_VALIDATE", bool, True, True, "call",
        "Cross-rank argument checks of the functional calls: unset, on the first call with a "
        "new signature per group; 1/true/on/yes on every call (a debug mode); 0/false/off/no "
        "never. Objects check at construction unless it is 0. The Ulysses calls and "
        "UlyssesAttention read it when they make a plan (a change takes effect at the next new "
        "plan or after attncomm.release(group)); the other calls on every call."),
    Var("ATTNCOMM_DCP_BACKEND", str, "", True, "call",
        "Backend DcpMerger(backend='auto') takes instead of choosing (empty: choose): "
        "reference, ag_rs, a2a or symm_a2a."),
    Var("ATTNCOMM_DCP_GATHER_BACKEND", str, "", True, "call",
        "Backend DcpQueryGather(backend='auto') takes instead of choosing (empty: choose): "
        "all_gather or symm."),
    Var("ATTNCOMM_ULYSSES_BACKEND", str, "", True, "plan",
        "Transport the Ulysses exchanges take for backend='auto' (empty: choose): all_to_all "
        "or ce. Read when a plan is made: a change takes effect at the next new plan or after "
        "attncomm.release(group)."),
    Var("ATTNCOMM_ULYSSES_PIPELINE_GROUPS", int, -1, True, "plan",
        "Head groups of UlyssesAttention(pipeline_groups=-1): 0 or 1 sequential, N >= 2 forces "
        "N (-1: automatic). Read when a forward plan is made: a change takes effect at the next "
        "new plan or after attncomm.release(group)."),
    Var("ATTNCOMM_PEER_MAPPING", str, "auto", True, "call",
        "How ranks map each other's symmetric slabs (symm_a2a, the gather's symm, Ulysses ce): "
        "'torch' SymmetricMemory, 'ipc' (CUDA IPC handles exchanged over the gloo group), or "
        "'auto': ipc where ranks share a GPU or torch's is unavailable, else torch. Read on a "
        "group's first symmetric-memory eligibility check.",
        choices=("auto", "torch", "ipc")),
    Var("ATTNCOMM_MACHINE", str, "", True, "call",
        "The machine's name recorded in benchmark JSON (meta.machine)."),
    # Private: tuning and test hooks, may change without notice.
    Var("ATTNCOMM_COMBINE_IMPL", str, "", False, "call",
        "Force the DCP combine's implementation ('torch' or 'triton'; empty: Triton on CUDA).",
        choices=("torch", "triton")),
    Var("ATTNCOMM_ULYSSES_CE_FLAGS", str, "auto", False, "plan",
        "How the ce transport signals peers: 'stream' memory ops, Triton 'kernel's, or 'auto' "
        "(read when a plan takes a transport).",
        choices=("auto", "stream", "kernel")),
    Var("ATTNCOMM_ULYSSES_CE_CACHE", int, 6, False, "once",
        "Staging buffers a ce transport keeps (least recently used evicted first).", minimum=1),
    # The symm_a2a rows are read each time a DcpMerger builds the backend (SymmConfig.from_env,
    # whose field defaults these mirror); SymmConfig checks the values.
    Var("ATTNCOMM_SYMM_MAX_BLOCK_ROWS", int, 64, False, "call",
        "symm_a2a: most token rows per block (a power of two).", minimum=1),
    Var("ATTNCOMM_SYMM_PROGRAMS_PER_SM", int, 1, False, "call",
        "symm_a2a: programs per SM in the grid bound.", minimum=1),
    Var("ATTNCOMM_SYMM_MAX_WARPS", int, 16, False, "call",
        "symm_a2a: most warps per program (blocks below 32 KiB).", minimum=1),
    Var("ATTNCOMM_SYMM_WIDE_WARPS", int, 32, False, "call",
        "symm_a2a: warps for blocks of 32 KiB or more, above MAX_WARPS (0: no exception).",
        minimum=0),
    Var("ATTNCOMM_SYMM_MAX_PROGRAMS", int, 0, False, "call",
        "symm_a2a: cap on the grid (0: none); a capped program loops over several blocks.",
        minimum=0),
    Var("ATTNCOMM_SYMM_LL_MAX_BYTES", int, 256 * 1024, False, "call",
        "symm_a2a: payload per peer up to which the LL protocol (a flag in every 8-byte word) "
        "is used.", minimum=0),
    Var("ATTNCOMM_SYMM_STAGGER_MIN_BYTES", int, 1 << 20, False, "call",
        "symm_a2a: payload per peer from which the flag protocol staggers its sends (0: never).",
        minimum=0),
    Var("ATTNCOMM_SYMM_STAGGER_SPLIT", int, 50, False, "call",
        "symm_a2a: percent of the grid in the first stagger group; below 50 the grid is cut "
        "into chained groups of that size; 100 or more: off.", minimum=0),
    Var("ATTNCOMM_SYMM_PDL", bool, True, False, "call",
        "symm_a2a: programmatic dependent launch (unset: on where supported, compute "
        "capability >= 9.0; 0: off; 1: on)."),
    Var("ATTNCOMM_TEST_HOST", str, "", False, "call",
        "Tests only: a name added to this process's host identity "
        "(capability.host_identity), so that the ranks of one machine act as several hosts "
        "(gloo CPU ranks in CI: W=4 as 2 hosts x 2 ranks). It can only split a machine, never "
        "make two machines look like one. Empty: the real identity."),
)

#: name → ``Var``, every ``ATTNCOMM_*`` variable attncomm reads.
VARS: dict[str, Var] = {v.name: v for v in _TABLE}

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def _var(name: str) -> Var:
    try:
        return VARS[name]
    except KeyError:
        raise KeyError(f"{name} is not in attncomm.config.VARS") from None


def raw(name: str) -> str:
    """The text of variable ``name`` as set, stripped ("" when unset). ``KeyError`` for a name
    that is not in the table."""
    if name not in VARS:
        _var(name)
    env = os.environ
    data = getattr(env, "_data", None)
    if data is None:  # os.environ replaced by another mapping: its own lookup
        return env.get(name, "").strip()
    # os.environ's own storage, by the key it encodes (what ``os.environ.get`` reads, without
    # the KeyError it raises and catches for an unset name: calls read these per call)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = env.encodekey(name)
    value = data.get(key)
    return "" if value is None else env.decodevalue(value).strip()


#: name → its key in ``os.environ``'s storage (``encodekey``)
_ENV_KEYS: dict = {}


def get(name: str):
    """The typed value of variable ``name``: its default when unset or empty, else the parsed
    text. Read from the environment on every call (a ``"once"`` variable is read once by the
    module that uses it).

    Raises:
        ValueError: the text does not parse as the variable's type, is not one of its choices,
            or is below its minimum (the message names the variable and the value).
        KeyError: ``name`` is not in the table.
    """
    var = _var(name)
    text = raw(name)
    if not text:
        return var.default
    if var.type is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError(f"{name}={text!r}: expected one of {'/'.join(_TRUE + _FALSE)}")
    if var.type in (int, float):
        try:
            value = var.type(text)
        except ValueError:
            kind = "an integer" if var.type is int else "a number"
            raise ValueError(f"{name}={text!r} is not {kind}") from None
        if var.minimum is not None and value < var.minimum:
            raise ValueError(f"{name}={text!r} is below its minimum {var.minimum:g}")
        return value
    if var.choices is not None and text not in var.choices:
        raise ValueError(f"{name}={text!r} is not one of {list(var.choices)}")
    return text


def overrides(prefix: str = "ATTNCOMM_") -> dict[str, str]:
    """``{name: text}`` of the table's variables starting with ``prefix`` that are set (for a
    benchmark's record of the settings it ran with)."""
    return {n: raw(n) for n in sorted(VARS) if n.startswith(prefix) and raw(n)}


def set_var(name: str, value) -> None:
    """Set the table's variable ``name`` to ``str(value)`` in this process's environment (and
    so its children's), or unset it when ``value`` is None. Raises ``ValueError`` for a name
    that is not in the table."""
    if name not in VARS:
        raise ValueError(f"{name} is not in attncomm.config.VARS")
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = str(value)


@contextlib.contextmanager
def setting(**values):
    """``with setting(ATTNCOMM_TIMEOUT_S=5):`` — the variables set (None: unset) inside the
    block, their previous values back after it (test harnesses drive the library this way)."""
    before = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            set_var(name, value)
        yield
    finally:
        for name, value in before.items():
            set_var(name, value)


# NVLink multicast can take a shared host's GPUs out of service: it stays off in NCCL, torch
# SymmetricMemory and NVSHMEM. ``import attncomm`` only fills these in where the caller left them
# unset (an engine's environment is its own); every process attncomm starts (launch's ranks, the
# CLI, the benches, the tests, scripts/) forces them.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def default_safe_env() -> None:
    """Set the multicast-off variables of ``SAFE_ENV`` where this process has none."""
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)


def force_safe_env() -> None:
    """Force NVLink multicast off for this process and every process it starts (for processes
    attncomm itself starts)."""
    os.environ.update(SAFE_ENV)


def timeout_s(value: float | None = None) -> float:
    """The wait budget in seconds: ``value`` if given, else env ``ATTNCOMM_TIMEOUT_S``, else 60.

    Raises ``ValueError`` for a non-positive or unparsable budget.
    """
    if value is None:
        text = raw("ATTNCOMM_TIMEOUT_S")
        if not text:
            return DEFAULT_TIMEOUT_S
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"ATTNCOMM_TIMEOUT_S={text!r} is not a number of seconds") from None
    value = float(value)
    if not value > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {value}")
    return value


def validate_enabled(value: bool | None = None, default: bool = True) -> bool:
    """Whether cross-rank argument checks run: ``value`` if given, else env ``ATTNCOMM_VALIDATE``
    ("0"/"false"/"off" disable, "1"/"true"/"on" enable), else ``default``."""
    if value is not None:
        return bool(value)
    if not raw("ATTNCOMM_VALIDATE"):
        return default
    return get("ATTNCOMM_VALIDATE")


def validation_mode(value: bool | None = None) -> str:
    """How a functional call checks its arguments across ranks: ``"every"`` call, the
    ``"first"`` call with a new signature (per group), or ``"never"``. ``value`` True/False
    means every/never; None reads ``ATTNCOMM_VALIDATE`` (unset: first sight; "1": every call,
    a debug mode, as ``TORCH_DISTRIBUTED_DEBUG`` is; "0": never)."""
    if value is not None:
        return "every" if value else "never"
    if not raw("ATTNCOMM_VALIDATE"):
        return "first"
    return "every" if get("ATTNCOMM_VALIDATE") else "never"


def env_backend(name: str, backend: str, choices: tuple[str, ...]) -> str:
    """Resolve ``backend="auto"`` against the override variable ``name`` (a row of the table,
    e.g. ``ATTNCOMM_DCP_BACKEND``): its value if set, else ``backend``.

    Raises ``ValueError`` naming the variable when its value is not one of ``choices``.
    """
    if backend == "auto":
        text = raw(name)
        if text:
            if text not in choices:
                raise ValueError(f"{name}={text!r} is not one of {list(choices)}")
            return text
    return backend
