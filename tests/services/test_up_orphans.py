"""`kvmesh up` killed with SIGKILL leaves no orphans: its Redis, kv_service, worker and router die too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kvmesh.loopback import free_port
from tests.support import wait_until


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigkill_of_kvmesh_up_takes_every_child_with_it(model_dir, tmp_path):
    ports = [free_port() for _ in range(5)]
    up = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", "up", "--model", str(model_dir), "--workers", "1",
         "--router-port", str(ports[0]), "--kv-service-port", str(ports[1]), "--worker-port", str(ports[2]),
         "--http-port", str(ports[4]), "--metrics-port", "0", "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    children: set[int] = set()
    try:
        for line in up.stdout:  # type: ignore[union-attr]
            if line.startswith("ready"):
                break
        else:
            raise AssertionError(f"kvmesh up exited with {up.wait()}; logs in {tmp_path}")
        children = descendants(up.pid)
        names = {(Path("/proc") / str(p) / "cmdline").read_bytes().replace(b"\0", b" ").decode() for p in children}
        assert any("redis-server" in n for n in names) and sum("kvmesh.cli" in n for n in names) == 3, names
        os.kill(up.pid, signal.SIGKILL)
        up.wait()
        wait_until(lambda: not any(alive(p) for p in children), timeout=30, what="the children of kvmesh up to exit")
    finally:
        for pid in [up.pid, *children]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)

