"""Rank functions for tests/test_launch.py that a separate launching process imports."""
from __future__ import annotations

import os
import time


def record_pid_and_sleep(rank, world_size, directory):
    with open(os.path.join(directory, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
