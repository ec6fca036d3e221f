"""A worker's share of its GPU (memory.py), with an H200's numbers injected: no GPU needed.

Workers that start together are a fake device with per-process counts (what NVML reports), their
starts interleaved step by step (issue 43)."""

from __future__ import annotations

import pytest
import torch

from kvmesh.model_worker.execution import memory
from kvmesh.model_worker.execution.memory import (
    DeviceMemory,
    Footprint,
    GiB,
    activation_reserve,
    graph_reserve,
    kv_cache_budget,
    process_memory,
    worker_share,
)

MiB = 2**20
H200 = 143_771 * MiB
"""What torch.cuda.mem_get_info reported as total on the project's H200 (notes/gpu_h200.md)."""
CONTEXT = 520 * MiB
"""A CUDA context: what a worker holds before it loads anything."""
WEIGHTS_1B = 3_000 * MiB
"""The 1.5B-parameter Llama shape in bf16."""


ACTIVATIONS = activation_reserve(2048, 2048, 8192)
GRAPHS = graph_reserve(128, 2048, 8192, 128_256)


class FakeDevice:
    """One GPU shared by processes: the device-wide free count and NVML's per-process counts."""

    def __init__(self, total: int = H200) -> None:
        self.total = total
        self.used: dict[int, int] = {}

    def take(self, pid: int, nbytes: int) -> None:
        self.used[pid] = self.used.get(pid, 0) + nbytes

    def read(self, pid: int) -> DeviceMemory:
        return DeviceMemory(total=self.total, free=self.total - sum(self.used.values()), process=self.used.get(pid))


class Worker:
    """A worker's start as model_runner.py runs it: context, read, share, load, budget, KV cache."""

    def __init__(self, device: FakeDevice, pid: int, fraction: float) -> None:
        self.device, self.pid, self.fraction = device, pid, fraction
        device.take(pid, CONTEXT)  # the CUDA context exists before the first reading

    def read_start(self) -> None:
        start = self.device.read(self.pid)
        self.footprint = Footprint(start, torch_reserved=0, counts_process=True)
        self.share = worker_share(start, self.fraction, self.footprint.held_at_start)

    def load_weights(self) -> None:
        self.device.take(self.pid, WEIGHTS_1B)
        self.torch_reserved = WEIGHTS_1B

    def allocate_kv(self) -> int:
        now = self.device.read(self.pid)
        held = self.footprint.held(now.process, self.torch_reserved)
        budget = kv_cache_budget(self.share, held=held, activations=ACTIVATIONS, graphs=GRAPHS)
        assert budget > 0, f"worker {self.pid}: KV budget {budget / GiB:.1f} GiB"
        self.device.take(self.pid, budget)
        return budget


def test_two_workers_at_0_4_started_together_both_get_the_same_kv_budget_in_any_interleaving() -> None:
    want = int(H200 * 0.4) - CONTEXT - WEIGHTS_1B - ACTIVATIONS - GRAPHS
    orders = [
        "AABBAB",  # one after the other's start... (A reads, A loads, B reads, B loads, A's KV, B's KV)
        "ABABAB",  # in lockstep
        "ABBBAA",  # B takes its whole share while A is loading
        "AAABBB",  # one after the other
    ]
    for order in orders:
        device = FakeDevice()
        workers = {"A": Worker(device, 1, 0.4), "B": Worker(device, 2, 0.4)}
        phase = {"A": 0, "B": 0}
        budgets = {}
        for name in order:
            w = workers[name]
            if phase[name] == 0:
                w.read_start()
            elif phase[name] == 1:
                w.load_weights()
            else:
                budgets[name] = w.allocate_kv()
            phase[name] += 1
        assert budgets == {"A": want, "B": want}, order
        assert sum(device.used.values()) <= 0.8 * H200 + 1


def test_workers_whose_fractions_sum_to_one_all_start_at_once() -> None:
    """Five workers at 0.2 (their contexts inside their shares), each step of each start interleaved
    with the others': every one starts and the device is full, not over."""
    device = FakeDevice()
    workers = [Worker(device, pid, 0.2) for pid in range(1, 6)]
    for w in workers:
        w.read_start()
    for w in workers:
        w.load_weights()
    budgets = [w.allocate_kv() for w in workers]
    assert len(set(budgets)) == 1
    assert H200 - 5 <= sum(device.used.values()) + 5 * (ACTIVATIONS + GRAPHS) <= H200


def test_the_device_wide_count_charged_a_worker_with_the_others_memory() -> None:
    """What went wrong (issue 43's H200 run): B's start saw A's KV cache appear and counted it as its own."""
    device = FakeDevice()
    a, b = Worker(device, 1, 0.4), Worker(device, 2, 0.4)
    b.read_start()
    a.read_start()
    a.load_weights()
    b.load_weights()
    a.allocate_kv()
    start, now = b.footprint.start, device.read(2)
    device_wide_other = start.free - now.free - WEIGHTS_1B  # the old rule's "what libraries took"
    assert int(H200 * 0.4) - WEIGHTS_1B - ACTIVATIONS - GRAPHS - device_wide_other < 0
    assert b.allocate_kv() > 0  # per-process: unaffected


def test_without_the_drivers_figure_torchs_allocations_are_counted() -> None:
    footprint = Footprint(DeviceMemory(total=H200, free=H200 - CONTEXT), torch_reserved=GiB, counts_process=True)
    assert footprint.held_at_start == 0
    assert footprint.held(None, 4 * GiB) == 3 * GiB
    second = Footprint(DeviceMemory(H200, H200 // 2, process=CONTEXT + 9 * GiB), torch_reserved=9 * GiB,
                       counts_process=False)  # a process's second engine: only what it adds
    assert second.held_at_start == 0 and second.held(CONTEXT + 12 * GiB, 12 * GiB) == 3 * GiB


def test_the_process_figure_comes_from_the_drivers_list_or_none_with_the_reason(caplog) -> None:
    device = torch.device("cuda", 0)
    props = type("Props", (), {"uuid": "1234-abcd"})()
    real = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda d: props  # type: ignore[assignment]
    try:
        seen: list[str] = []
        listing = lambda uuid: seen.append(uuid) or {41: 3 * GiB, 42: GiB}  # noqa: E731
        assert process_memory(device, listing, pid=41) == 3 * GiB and seen == ["GPU-1234-abcd"]
        memory._WARNED.clear()
        assert process_memory(device, listing, pid=7) is None
        assert "NVML does not list this process (pid 7; a PID namespace?)" in caplog.text

        def no_nvml(uuid: str) -> dict[int, int]:
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

        assert process_memory(device, no_nvml, pid=41) is None
        assert "NVML cannot list the device's processes (libnvidia-ml.so.1" in caplog.text
    finally:
        torch.cuda.get_device_properties = real  # type: ignore[assignment]


def test_a_share_that_is_not_free_is_refused_with_what_is_free_and_what_to_set() -> None:
    free = H200 - 2 * (int(H200 * 0.4) + CONTEXT) - CONTEXT  # two workers at 0.4 already
    with pytest.raises(ValueError) as err:
        worker_share(DeviceMemory(total=H200, free=free), 0.4)
    msg = str(err.value)
    assert "--memory-fraction 0.4 asks for 56.2 GiB of this GPU's 140.4 GiB" in msg
    assert f"only {free / GiB:.1f} GiB are free" in msg
    assert "set --memory-fraction 0.18 or less" in msg
    # ... and what it suggests starts.
    assert worker_share(DeviceMemory(total=H200, free=free), 0.18) == int(H200 * 0.18)


def test_a_full_device_says_so() -> None:
    with pytest.raises(ValueError, match="free the device"):
        worker_share(DeviceMemory(total=H200, free=H200 // 200), 0.5)


def test_the_kv_budget_is_the_share_less_what_else_the_worker_holds() -> None:
    share = 10 * GiB
    assert kv_cache_budget(share, held=3 * GiB, activations=GiB, graphs=GiB // 2) == share - 3 * GiB - GiB - GiB // 2
    # Activations: 2048 tokens x 4 bytes x (2 x 8192 + 4 x 2048) x 4 = 768 MiB for the 1B shape.
    assert activation_reserve(2048, 2048, 8192) == 768 * MiB
    assert graph_reserve(0, 2048, 8192, 128_256) == 0
    assert graph_reserve(128, 2048, 8192, 128_256) == 48 * MiB + 2 * 128 * 128_256 * 4


def test_a_share_counts_the_context_it_holds_already() -> None:
    """Two workers at 0.5: the second finds the first's half and its own context taken, and starts."""
    free = H200 - int(H200 * 0.5) - CONTEXT
    assert worker_share(DeviceMemory(total=H200, free=free), 0.5, held=CONTEXT) == int(H200 * 0.5)
    with pytest.raises(ValueError):
        worker_share(DeviceMemory(total=H200, free=free), 0.5)  # without it: refused
