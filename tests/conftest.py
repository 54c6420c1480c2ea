"""Shared fixtures: one pool of gloo CPU ranks per world size for the whole test session.

Spawning ranks costs seconds, so each world size is started once and many cases run inside it.
A test function that runs on the ranks must be module-level (picklable) and take
``(rank, world_size, *args)``.
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("ATTNCOMM_TIMEOUT_S", "60")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors under the interpreter (set before triton is imported;
    # spawned ranks inherit it).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attncomm import config  # noqa: E402
from attncomm.launch import RankPool  # noqa: E402

# The test session is a process attncomm starts: NVLink multicast stays off in it and its ranks.
config.force_safe_env()


class _Pools:
    """One reused ``RankPool`` per world size on ``device`` ("cpu": gloo ranks; "cuda": rank r
    on GPU ``r % n``, one GPU each (NCCL) when there are enough, else sharing them (gloo))."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = RankPool(world_size, device=self.device)
            self._pools[world_size] = pool
        return pool

    def run(self, world_size: int, fn, *args, timeout_s: float = 300, **kwargs) -> list:
        """Run ``fn(rank, world_size, *args)`` on a (reused) pool of ``world_size`` ranks."""
        return self.get(world_size).run(fn, *args, timeout_s=timeout_s, **kwargs)

    def close(self):
        for pool in self._pools.values():
            pool.close(force=not pool.alive)
        self._pools.clear()


@pytest.fixture(scope="session")
def pools():
    p = _Pools()
    yield p
    p.close()


@pytest.fixture(scope="session")
def cuda_pools():
    """The GPU tests' ranks: ``cuda_pools.run(W, fn, *args, timeout_s=...)`` runs on a reused
    ``RankPool(W, device="cuda")``. With at least W GPUs each rank has its own (NCCL); with
    fewer, W processes share them (gloo group, CUDA tensors staged through the host, peers
    mapped by CUDA IPC), so one GPU runs every world size. Skips without CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (cuda_pools)")
    p = _Pools("cuda")
    yield p
    p.close()


#: The seed every randomized test draws its data from: fixed, so that CI is deterministic (random
#: exploration is ``python -m attncomm.testing.fuzz``); ``--seed N`` runs the tests with another.
SEED = 1


@pytest.fixture(scope="module")
def one_rank_group():
    """For the one-GPU test files: a W=1 gloo default group in the test process (the module
    API's group=None), on a machine with a CUDA GPU; skips without one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield None


def pytest_addoption(parser):
    parser.addoption("--seed", type=int, default=None,
                     help=f"seed of the randomized tests (the `seed` fixture; default {SEED})")


@pytest.fixture
def seed(request) -> int:
    """The seed of a randomized test (``SEED`` or ``--seed``); every failure report of a test
    that takes it names it (``pytest_runtest_makereport``)."""
    value = request.config.getoption("--seed")
    return SEED if value is None else value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    value = getattr(item, "funcargs", {}).get("seed")
    if rep.failed and value is not None:
        text = f"seed {value} (again: python -m pytest '{item.nodeid}' --seed {value})"
        if hasattr(rep.longrepr, "addsection"):
            rep.longrepr.addsection("seed", text)
        else:
            rep.sections.append(("seed", text))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): the test needs n CUDA GPUs (default 1 for "
                                       "a gpu-marked test); skipped on a machine with fewer")


def gpu_skip_reason(need: int, count: int, cuda: bool) -> str | None:
    """Why a test that needs ``need`` GPUs cannot run on a machine with ``count`` (None: it
    can)."""
    if not cuda:
        return "needs CUDA GPUs (run them on a CUDA machine: bash scripts/gpu_check.sh)"
    if count < need:
        return f"needs {need} CUDA GPUs, this machine has {count}"
    return None


def pytest_collection_modifyitems(config, items):
    # GPU tests run through scripts/gpu_check.sh on the device machine, not in CI; each skips
    # cleanly when the machine has fewer GPUs than its gpus(n) marker asks for.
    try:
        import torch
        cuda = torch.cuda.is_available()
        count = torch.cuda.device_count() if cuda else 0
    except Exception:  # noqa: BLE001
        cuda, count = False, 0
    for item in items:
        if "gpu" not in item.keywords:
            continue
        marker = item.get_closest_marker("gpus")
        why = gpu_skip_reason(int(marker.args[0]) if marker else 1, count, cuda)
        if why:
            item.add_marker(pytest.mark.skip(reason=why))
