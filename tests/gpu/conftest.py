"""Fixtures the one-GPU test files share."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_rank_group():
    """A W=1 gloo default group in the test process (the module API's group=None), on a machine
    with a CUDA GPU; skips without one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield None
