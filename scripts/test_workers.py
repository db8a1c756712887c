"""How many pytest-xdist workers `make test` runs: 2 where 12 GB of memory are free, else 0
(one process). Two workers' servers peaked at ~10 GB on a 2-core host (docs/measurements.md).

Free memory is the smaller of /proc/meminfo's MemAvailable and what the cgroup's memory limit
leaves (v2 `memory.max` - `memory.current`, v1 `memory.limit_in_bytes` - `memory.usage_in_bytes`):
in a container /proc/meminfo shows the host's memory, not the container's. Standard library
only: it runs before the tests' environment is needed.

    python3 scripts/test_workers.py    # prints 2 or 0
"""

from __future__ import annotations

import sys
from pathlib import Path

NEEDED_BYTES = 12 * 2**30
WORKERS = 2


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _bytes(path: Path) -> int | None:
    text = _read(path).strip()
    return int(text) if text.isdigit() else None  # v2's "max": no limit


def free_bytes(root: Path = Path("/")) -> int | None:
    """Memory this process's cgroup and the host both still have, None where neither says."""
    free = [
        int(line.split()[1]) * 1024
        for line in _read(root / "proc/meminfo").splitlines()
        if line.startswith("MemAvailable:")
    ]
    cgroup = root / "sys/fs/cgroup"
    for limit, usage in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        cap, used = _bytes(cgroup / limit), _bytes(cgroup / usage)
        if cap is not None and used is not None:
            free.append(cap - used)
    return min(free) if free else None


def workers(free: int | None) -> int:
    return WORKERS if free is not None and free >= NEEDED_BYTES else 0


if __name__ == "__main__":
    sys.stdout.write(f"{workers(free_bytes())}\n")
