"""One simulated run's settings (:class:`SimConfig`) and what is derived from them alone: each worker's
GPU and KV capacity, the fleet's, the SLO's cold-prefill cost."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.contract.settings import code_only, flag
from kvmesh.kv_client.event_batcher import BATCH_INTERVAL_S
from kvmesh.kv_service.config import ServiceConfig
from kvmesh.model_worker.scheduling.config import SchedulerConfig
from kvmesh.model_worker.simulated.step_time import StepTimeConfig, StepTimeModel, gpu_spec
from kvmesh.router.config import RoutingConfig
from kvmesh.sim.fleet import parse_fleet
from kvmesh.sim.goodput import parse_objectives

MODEL_ID = "sim-8b"

LINKS = {"nvlink": 450e9, "rdma": 50e9, "pcie": 64e9}
"""Prefill/decode disaggregation: a link's bytes per second, one direction (sources in kvmesh/sim/pd.py)."""


def parse_pd(spec: str) -> tuple[int, int]:
    """``"2:6"`` -> (2 prefill workers, 6 decode workers) (``--pd``). Raises ValueError naming the flag."""
    p, sep, d = spec.partition(":")
    try:
        np_, nd = int(p), int(d)
    except ValueError:
        raise ValueError(f"--pd takes PREFILL:DECODE worker counts, e.g. 2:6, got {spec!r}") from None
    if not sep or np_ < 1 or nd < 1:
        raise ValueError(f"--pd takes PREFILL:DECODE worker counts, each >= 1, e.g. 2:6, got {spec!r}")
    return np_, nd
PLACEHOLDER_TOKEN = 2


def _sim_engine() -> SchedulerConfig:
    return SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=131_072)


@dataclass(slots=True)
class SimConfig:
    """One simulated run: the mesh, the live system's settings and delays, the faults, the SLO.

    Where a setting is the live system's (the routers' RoutingConfig, the engines' SchedulerConfig,
    the publisher's batching interval, the kv_service's lease), it is that declaration, with that
    flag name; `kvmesh simulate` derives every flag from these fields.
    """

    workers: str = flag("8", metavar="N|NxGPU,...")
    """Simulated workers: N of --sim-gpu, or a fleet of GPU types, e.g. 4xH100,4xA100 (kvmesh/sim/fleet.py;
    an int is taken as N)."""
    routers: int = 1
    """Routers sharing the index; arrivals are dealt to them in turn, each with its own in-flight view."""
    replica_sync: bool = True
    """With --routers > 1, a policy whose original syncs its replicas runs in that mode (dynamo:
    --router-replica-sync, active-sequence events batched 1 ms; kvmesh/sim/replicas.py); off: each router's
    state stays its own."""
    seed: int = 0
    """Seeds the token synthesis, the policies' tie-breaks and the faults."""
    rate: float = code_only(1.0)
    """Offered load: the workload's own arrival rate times this (set per run)."""
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    """The routers' settings: the live router's (a group: its fields are the flags)."""
    # -- engines
    engine: SchedulerConfig = field(default_factory=_sim_engine)
    """The engines' scheduling: the live worker's settings (a group), an H100's defaults."""
    block_size: int = 64
    """Tokens per KV block (the live default is 16: 64 keeps the Python work per block of the real block
    pool and index a quarter as large; docs/benchmarks.md, simulator speed)."""
    num_blocks: int | None = None
    """KV blocks per worker; none = what each worker's GPU holds (an H100: 442,368 tokens, 27,648 blocks of 16)
    in blocks of --block-size."""
    host_kv_blocks: int = 0
    """Host KV tier per worker, in blocks of --block-size: blocks evicted from the device are kept there and
    loaded back over the GPU's host link (docs/engine.md, Host KV tier); 0 = none."""
    max_loras: int = 4
    """With a workload of LoRA adapters: each worker's GPU adapter slots (vLLM's --max-loras; the scheduler runs
    no more distinct adapters at once), the adapters loaded into them as steps need them
    (model_worker/simulated/sim_lora.py, docs/adapters.md)."""
    max_cpu_loras: int = 16
    """With a workload of LoRA adapters: adapters each worker keeps in host memory (LRU); 0 = every load is from
    disk."""
    window_steps: int = 64
    """Longest decode window simulated as one event with --num-scheduler-steps 1 (kvmesh/sim/engine.py)."""
    step_time: StepTimeConfig = field(default_factory=StepTimeConfig)
    """The workers' step time: model, GPU, noise (a group: --sim-cost-model, --sim-gpu, --sim-step-noise)."""
    cost: StepTimeModel | None = code_only(None)
    """One step-time model for every worker instead of each one's GPU (the linear model of the --sim-*
    coefficients; a toy model in tests)."""
    # -- the live system's delays
    event_batch_s: float = flag(BATCH_INTERVAL_S, name="event-batch-interval")
    """Seconds between two event messages of a worker, at least (the live publisher's)."""
    event_delay_s: float = flag(0.002, name="event-delay")
    """Seconds an event message takes from the worker to the index."""
    load_reports: str = "events"
    """events: event messages carry the load and a changed load goes out alone (the live worker);
    heartbeat: only heartbeats report it (the worker until 2026-11-22)."""
    index: ServiceConfig = field(default_factory=ServiceConfig)
    """The kv_service's settings (a group: --lease-ttl-ms, workers heartbeat every third of it as the live
    publisher does; the routers' picks, --pending-*)."""
    lookup_latency_s: float = flag(0.002, name="lookup-latency")
    """Seconds of one Lookup round trip (measured ~2 ms p50 on loopback, docs/benchmarks.md)."""
    read_replica_lag_s: float = flag(0.0, name="read-replica-lag")
    """Seconds a replica that answers the Lookups trails the primary (kv_service --read-replicas: a write
    reaches a replica p50 0.1 ms, p99 3.5 ms after the master under churn, docs/kv-service.md); writes,
    Reserve and discovery stay on the primary. 0 = Lookups from the primary."""
    reserve_latency_s: float = flag(0.001, name="reserve-latency")
    """Seconds of one Reserve round trip of the shared router view; the pick lands in the index halfway.
    Measured live 0.71 ms p50, 3.8 ms p99 (benchmarks/reserve_latency.py, docs/router.md "Several
    routers"); 1 ms rounds it up, so the window in which two routers' reservations race is not shorter than live."""
    network_s: float = flag(0.001, name="network-delay")
    """Seconds of one hop router <-> worker (request out, first token and end of stream back)."""
    # -- faults
    event_loss: float = 0.0
    """Share of event messages lost on the way to the index (the next one is then out of order: RESYNC,
    snapshot)."""
    restart_at: list[float] = field(default_factory=list)
    """When worker 0 is killed, as fractions of the arrival span (0.5 = mid-trace, at any rate); it is back
    --restart-down later with an empty cache and a new epoch."""
    restart_down_s: float = flag(2.0, name="restart-down")
    """Seconds a restarted worker stays down."""
    # -- SLO
    slo_ttft_s: float = flag(2.0, name="slo-ttft")
    """TTFT limit: this many seconds ..."""
    slo_ttft_prefill_x: float = 2.0
    """... plus this many times the request's own cold prefill time on the cost model."""
    slo_tpot_s: float = flag(0.1, name="slo-tpot")
    """Mean TPOT limit in seconds."""
    slo_itl_s: float = flag(0.0, name="slo-itl")
    """ITL limit in seconds: a request's longest gap between two tokens (what a chat user feels as a stall), beside
    the TTFT and TPOT limits; 0 = none."""
    slo_target: float = 0.9
    """Capacity = the highest rate with at least this share of requests meeting the SLO."""
    objectives: str = flag("", metavar="workload|TTFT_MS:TPOT_MS")
    """Latency objectives every request carries to its router (``RouteQuery.objectives``) and goodput counts
    (requests/s meeting both): ``workload`` = the workload's own (kvmesh/sim/goodput.py: TTFT 2x the cold prefill of
    its p90 prompt, >= 1 s; TPOT 50 ms), or TTFT_MS:TPOT_MS; empty = none (no goodput; the SLO above is the
    capacity's, not the requests')."""
    # -- prefill/decode disaggregation (kvmesh/sim/pd.py)
    pd: str = flag("", metavar="P:D")
    """A P/D fleet: P prefill and D decode workers (instead of --workers); policies with +always, +auto (kvmesh's
    decision) or +pd (a peer's own decider) split requests, the others run the same P + D workers aggregated."""
    pd_link: str = flag("rdma", metavar="nvlink|rdma|pcie")
    """The link a prompt's KV crosses from a prefill worker to a decode worker: nvlink 450 GB/s, rdma 50 GB/s, pcie
    64 GB/s one way (sources in kvmesh/sim/pd.py)."""
    llmd_non_cached_tokens: int = 0
    """llm-d+pd: the prefix-based P/D decider's nonCachedTokens (0 = always split: its code's default and its P/D
    guide's value)."""
    dynamo_max_local_prefill: int = 1000
    """dynamo+pd: max_local_prefill_length of Dynamo's conditional disaggregation (its default)."""
    dynamo_max_prefill_queue: int = 2
    """dynamo+pd: max_prefill_queue_size (its default)."""
    pd_split: str = code_only("")
    """The run's P/D mode from its policy name's suffix ("" aggregated, always, auto, pd)."""
    stop_when_slo_lost: bool = code_only(False)
    """End the run as soon as more than ``1 - slo_target`` of the requests missed the SLO (the
    capacity search only needs to know that attainment fell below the target)."""

    def __post_init__(self) -> None:
        if isinstance(self.workers, int):
            self.workers = str(self.workers)

    @property
    def policy(self) -> str:
        return self.routing.policy

    def worker_gpus(self) -> list[str]:
        """Each worker's GPU type, in worker order (a P/D fleet: its P + D workers of --sim-gpu)."""
        if self.pd:
            return [self.step_time.gpu] * sum(parse_pd(self.pd))
        return parse_fleet(self.workers, self.step_time.gpu)

    @property
    def num_workers(self) -> int:
        return len(self.worker_gpus())

    def cost_for(self, gpu: str) -> StepTimeModel:
        """The step-time model of a worker on ``gpu``."""
        return self.cost if self.cost is not None else self.step_time.model(gpu)

    @property
    def load_on_events(self) -> bool:
        return self.load_reports == "events"

    @property
    def heartbeat_s(self) -> float:
        return self.index.lease_ttl_ms / 1000 / 3

    def check(self) -> None:
        """Raises ValueError with the flag to fix."""
        if self.routers < 1:
            raise ValueError("--routers must be >= 1")
        if self.max_loras < 1 or self.max_cpu_loras < 0:
            raise ValueError(f"--max-loras must be >= 1 and --max-cpu-loras >= 0, got {self.max_loras}, "
                             f"{self.max_cpu_loras}")
        if self.host_kv_blocks < 0:
            raise ValueError(f"--host-kv-blocks must be >= 0 (0 = no host tier), got {self.host_kv_blocks}")
        self.step_time.check()
        for gpu in dict.fromkeys(self.worker_gpus()):
            self.cost_for(gpu)
        if self.read_replica_lag_s < 0:
            raise ValueError(f"--read-replica-lag must be >= 0 seconds, got {self.read_replica_lag_s}")
        if not 0 <= self.event_loss < 1:
            raise ValueError(f"--event-loss must be in [0, 1), got {self.event_loss}")
        if not all(0 <= f <= 1 for f in self.restart_at):
            raise ValueError("--restart-at takes fractions in [0, 1]")
        if self.load_reports not in ("events", "heartbeat"):
            raise ValueError(f"--load-reports must be events or heartbeat, got {self.load_reports!r}")
        self.routing.check()
        self.engine.validate()
        if self.pd:
            parse_pd(self.pd)
            if self.pd_link not in LINKS:
                raise ValueError(f"--pd-link must be one of {', '.join(LINKS)}, got {self.pd_link!r}")
        parse_objectives(self.objectives)
        if self.slo_itl_s < 0:
            raise ValueError(f"--slo-itl must be >= 0 seconds (0 = none), got {self.slo_itl_s}")

    def blocks_per_worker(self, gpu: str | None = None) -> int:
        """KV blocks of a worker on ``gpu`` (default: --sim-gpu): --num-blocks, or what the GPU holds."""
        return self.num_blocks or gpu_spec(gpu or self.step_time.gpu).kv_tokens() // self.block_size + 1



def fleet_capacity_blocks(cfg: SimConfig) -> int:
    """Usable KV blocks of the whole fleet: each worker's pool less its null block, and its host tier
    (a block there is a hit too: it is loaded back, not recomputed)."""
    return sum(cfg.blocks_per_worker(gpu) - 1 + cfg.host_kv_blocks for gpu in cfg.worker_gpus())


def slo_cost(cfg: SimConfig) -> StepTimeModel:
    """The step-time model the SLO's cold prefill is costed on: the fleet's slowest GPU type's (so
    every request can meet the SLO on any worker at no load)."""
    costs = [cfg.cost_for(g) for g in dict.fromkeys(cfg.worker_gpus())]
    return max(costs, key=lambda c: c.step_time([(0, cfg.engine.max_num_batched_tokens)], []))


def cold_prefill_s(cost: StepTimeModel, budget: int, prompt_len: int) -> float:
    """A prompt's prefill alone on an idle worker, chunked as the engine chunks it (``budget`` tokens a step)."""
    t, start = 0.0, 0
    while start < prompt_len:
        n = min(budget, prompt_len - start)
        t += cost.step_time([(start, n)], [])
        start += n
    return t
