"""Real infrastructure on loopback: free ports and a private redis-server (`kvmesh up`, tests, benchmarks)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

# NOTE: util-linux's setpriv sets PR_SET_PDEATHSIG and execs the command. It replaces a
# preexec_fn: Python code between fork and exec in a process with grpc threads can deadlock (a
# lock such as malloc's held by another thread at the fork), and a test run hung so in Popen.
_SETPRIV = shutil.which("setpriv") if sys.platform == "linux" else None


def die_with_parent(sig: str = "TERM") -> list[str]:
    """A command prefix that makes the child get SIG``sig`` when the thread that starts it dies
    (this process, SIGKILL included): ``setpriv --pdeathsig``; empty where setpriv is missing.

    Start children from a thread that lives as long as they should (the main thread).
    """
    return [_SETPRIV, "--pdeathsig", sig, "--"] if _SETPRIV else []


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(lo: int = 20000, hi: int = 32000) -> int:
    """A loopback TCP port that is free now, drawn at random from ``[lo, hi)``.

    NOTE: the range lies below the kernel's ephemeral range (32768+ on Linux), which the
    kernel hands out to every outgoing connection and every bind to port 0. A port taken from
    there (bind 0, close, hand the number on) can be grabbed by some other process's client
    socket before our server binds it, or after a killed server's restart on the same port; on
    a busy shared host both happened. Only an explicit bind of the same number can collide here.
    """
    return free_port_run(1, lo, hi)


_HANDED_OUT: set[int] = set()
"""Ports this process has handed out: never handed out twice, as a port handed out is free only
until its server binds it (two calls in a row would otherwise both see the same port free)."""


def free_port_run(n: int, lo: int = 20000, hi: int = 32000) -> int:
    """A port ``p`` with ``p .. p+n-1`` all free on 127.0.0.1 now (checked by binding them), drawn
    from the same range as :func:`free_port` (a stack that numbers its ports from one base)."""
    eph_lo, eph_hi = _ephemeral_range()
    if lo < eph_hi and hi > eph_lo:  # an unusual ephemeral range: stay clear of it if we can
        lo, hi = (1024, eph_lo) if eph_lo - 1024 >= 2000 else (eph_hi + 1, 65536)
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(lo, hi - n + 1)
        if not _HANDED_OUT.isdisjoint(range(base, base + n)):
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                socks.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                socks[-1].bind(("127.0.0.1", port))
            _HANDED_OUT.update(range(base, base + n))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free loopback ports in [{lo}, {hi})")


class RedisServer:
    """A private ``redis-server`` on a free loopback port, no persistence, in a temp dir."""

    def __init__(self, port: int | None = None, extra_args: tuple[str, ...] = (), password: str | None = None) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: run `make setup` (it installs it with apt)")
        self.port = port or free_port()
        self.password = password
        self._dir = tempfile.mkdtemp(prefix="kvmesh-redis-")
        self.proc = subprocess.Popen(
            [*die_with_parent(), exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self._dir, "--daemonize", "no", *(["--requirepass", password] if password else []),
             *extra_args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_ready()

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                    if reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
