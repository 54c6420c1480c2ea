"""Environment-driven defaults (timeouts, validation, backend overrides) and safety settings."""
from __future__ import annotations

import os

__all__ = ["timeout_s", "validate_enabled", "env_backend", "default_safe_env", "force_safe_env", "SAFE_ENV", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 60.0

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
        raw = os.environ.get("ATTNCOMM_TIMEOUT_S")
        if raw is None or raw.strip() == "":
            return DEFAULT_TIMEOUT_S
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"ATTNCOMM_TIMEOUT_S={raw!r} is not a number of seconds") from None
    value = float(value)
    if not value > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {value}")
    return value


def validate_enabled(value: bool | None = None, default: bool = True) -> bool:
    """Whether cross-rank argument checks run: ``value`` if given, else env ``ATTNCOMM_VALIDATE``
    ("0"/"false"/"off" disable, "1"/"true"/"on" enable), else ``default``."""
    if value is not None:
        return bool(value)
    raw = os.environ.get("ATTNCOMM_VALIDATE")
    if raw is None or raw.strip() == "":
        return default
    raw = raw.strip().lower()
    if raw in ("0", "false", "off", "no"):
        return False
    if raw in ("1", "true", "on", "yes"):
        return True
    raise ValueError(f"ATTNCOMM_VALIDATE={raw!r}: expected 0/1/true/false/on/off")


def env_backend(name: str, backend: str, choices: tuple[str, ...]) -> str:
    """Resolve ``backend="auto"`` against an override env var (e.g. ``ATTNCOMM_DCP_BACKEND``)."""
    if backend == "auto":
        raw = os.environ.get(name, "").strip()
        if raw:
            if raw not in choices:
                raise ValueError(f"{name}={raw!r} is not one of {list(choices)}")
            return raw
    return backend
