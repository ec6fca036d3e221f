"""Real infrastructure on loopback: free ports, a private redis-server and Redis Cluster (`kvmesh up`, tests,
benchmarks)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

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


def _cluster_ports(n: int) -> list[int]:
    """``n`` loopback ports whose cluster bus ports (+10000) are free too, all below the kernel's
    ephemeral range (see :func:`free_port`)."""
    ports: list[int] = []
    while len(ports) < n:
        p = free_port(20000, 22000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", p + 10000))
            except OSError:
                continue
        ports.append(p)
    return ports


class RedisCluster:
    """A private Redis Cluster on loopback: ``masters`` masters and ``replicas`` replicas of each,
    no persistence (each node keeps only its ``nodes.conf``, so a killed node restarted on its
    port rejoins with its slots and no data), in a temp dir. Built with ``redis-cli --cluster
    create``, as an operator would.

    Args:
        node_timeout_ms: ``cluster-node-timeout``: a master unreachable this long is marked failed
            and a replica of it promoted.
        cpus: pin node ``i`` to CPU ``cpus[i % len(cpus)]`` with ``taskset`` (benchmarks).
    """

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000,
                 cpus: Sequence[int] = (), extra_args: tuple[str, ...] = ()) -> None:
        self._exe = shutil.which("redis-server")
        cli = shutil.which("redis-cli")
        if self._exe is None or cli is None:
            raise RuntimeError("redis-server and redis-cli are not installed: run `make setup` (it installs them with apt)")
        self._cli = cli
        self.masters, self.replicas = masters, replicas
        self.node_timeout_ms = node_timeout_ms
        self._cpus = list(cpus)
        self._extra = extra_args
        self._dir = tempfile.mkdtemp(prefix="kvmesh-redis-cluster-")
        self.ports = _cluster_ports(masters * (1 + replicas))
        self.procs: list[subprocess.Popen | None] = [None] * len(self.ports)
        try:
            for i in range(len(self.ports)):
                self.start_node(i)
            subprocess.run(
                [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-replicas",
                 str(replicas), "--cluster-yes"], check=True, capture_output=True, timeout=60)
            self.wait_ok()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """Node 0's URL: the seed a client starts from."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start_node(self, i: int) -> None:
        """Starts (or restarts, after :meth:`kill`) node ``i`` on its port, with its nodes.conf."""
        port = self.ports[i]
        d = Path(self._dir) / str(port)
        d.mkdir(exist_ok=True)
        pin = ["taskset", "-c", str(self._cpus[i % len(self._cpus)])] if self._cpus and shutil.which("taskset") else []
        self.procs[i] = subprocess.Popen(
            [*die_with_parent(), *pin, self._exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(d), "--daemonize", "no", "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(self.node_timeout_ms),
             "--cluster-require-full-coverage", "no", *self._extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while self.cli(i, "PING") != "PONG":
            if time.monotonic() > deadline or self.procs[i].poll() is not None:  # type: ignore[union-attr]
                raise RuntimeError(f"redis-server (cluster node) did not start on port {port}")
            time.sleep(0.02)

    def kill(self, i: int) -> None:
        """``kill -9`` node ``i``."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def cli(self, i: int, *args: str) -> str:
        """One command to node ``i`` with redis-cli; its output ('' when the node does not answer)."""
        try:
            out = subprocess.run([self._cli, "-p", str(self.ports[i]), *args], capture_output=True, text=True,
                                 timeout=5)
        except subprocess.TimeoutExpired:
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    def nodes(self, i: int = 0) -> list[dict]:
        """CLUSTER NODES as node ``i`` sees it: port, role ('master' / 'slave'), flags, master id, id."""
        out = []
        for line in self.cli(i, "CLUSTER", "NODES").splitlines():
            f = line.split()
            out.append({"id": f[0], "port": int(f[1].split("@")[0].rsplit(":", 1)[1]), "flags": f[2],
                        "role": "master" if "master" in f[2] else "slave", "master": f[3], "slots": f[8:]})
        return out

    def master_ports(self, i: int = 0) -> list[int]:
        """Ports of the masters that serve slots, as node ``i`` sees them, in slot order."""
        ms = [n for n in self.nodes(i) if n["role"] == "master" and n["slots"] and "fail" not in n["flags"]]
        return [n["port"] for n in sorted(ms, key=lambda n: int(n["slots"][0].split("-")[0]))]

    def wait_ok(self, timeout: float = 30.0, nodes: Sequence[int] | None = None) -> None:
        """Until every running node (or those given) says cluster_state:ok and knows every node."""
        deadline = time.monotonic() + timeout
        idx = list(nodes) if nodes is not None else [i for i, p in enumerate(self.procs) if p and p.poll() is None]
        while True:
            if all("cluster_state:ok" in self.cli(i, "CLUSTER", "INFO")
                   and len(self.nodes(i)) == len(self.ports) for i in idx):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.05)

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            if proc is not None:
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
