"""`make test`'s worker count (scripts/test_workers.py): two workers only where the host and the
cgroup both leave 12 GB."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "test_workers.py"
spec = importlib.util.spec_from_file_location("test_workers_script", SCRIPT)
test_workers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(test_workers)
GB = 2**30


def _root(tmp_path: Path, available_kb: int | None, cgroup: dict[str, str]) -> Path:
    if available_kb is not None:
        (tmp_path / "proc").mkdir()
        (tmp_path / "proc/meminfo").write_text(f"MemTotal: 99 kB\nMemAvailable: {available_kb} kB\n")
    for name, value in cgroup.items():
        path = tmp_path / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")
    return tmp_path


@pytest.mark.parametrize(
    "available_gb,cgroup,workers",
    [
        (64, {}, 2),  # a host with room, no cgroup limit
        (8, {}, 0),
        (64, {"memory.max": "max", "memory.current": str(GB)}, 2),  # v2, unlimited
        (64, {"memory.max": str(8 * GB), "memory.current": str(GB)}, 0),  # a container granted 8 GB on a big host
        (64, {"memory/memory.limit_in_bytes": str(16 * GB), "memory/memory.usage_in_bytes": str(GB)}, 2),  # v1
        (64, {"memory/memory.limit_in_bytes": str(16 * GB), "memory/memory.usage_in_bytes": str(6 * GB)}, 0),
        (None, {}, 0),  # nothing says: one process
    ],
)
def test_two_workers_only_where_host_and_cgroup_leave_room(tmp_path, available_gb, cgroup, workers):
    kb = None if available_gb is None else available_gb * GB // 1024
    assert test_workers.workers(test_workers.free_bytes(_root(tmp_path, kb, cgroup))) == workers


def test_the_script_prints_a_worker_count():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.strip() in {"0", "2"}
