"""kvmesh parts as child processes of a benchmark, and what a benchmark reads of them."""

from __future__ import annotations

import subprocess
from pathlib import Path

from kvmesh.loopback import free_port
from kvmesh.stack import kvmesh_cmd, wait_serving


def start_kv_service(*flags: str, timeout: float = 30.0) -> tuple[subprocess.Popen, str]:
    """A `kvmesh kv-service` on a free loopback port, SERVING; returns (process, host:port).

    Leases last an hour (a benchmark registers workers that never heartbeat) unless ``flags`` say.
    """
    port = free_port()
    proc = subprocess.Popen(kvmesh_cmd("kv-service", "--host", "127.0.0.1", "--port", str(port),
                                       "--metrics-port", "0", "--lease-ttl-ms", "3600000", "--log-level", "warning",
                                       *flags))
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, proc, timeout)
    except Exception:
        proc.kill()
        raise
    return proc, address


def rss_kib(pid: int) -> int:
    """Resident memory of a process (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0
