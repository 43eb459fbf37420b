"""Whether this process is a rank of a world a launcher described (torch-free, so the CLI
can ask before it imports torch): torchrun, the DeepSpeed launcher and our own spawner set
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""

from __future__ import annotations

import os

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def in_launched_world() -> bool:
    return all(k in os.environ for k in LAUNCH_ENV)
