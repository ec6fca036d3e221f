"""Prefill/decode disaggregation in virtual time (``kvmesh simulate --pd P:D``).

The fleet is P prefill workers and D decode workers (``--pd P:D``); the same P + D workers serve every
request themselves in the aggregated mode. A policy name carries the mode (:func:`parse_policy`):

| policy              | mode                                                                          |
|---------------------|-------------------------------------------------------------------------------|
| ``kv-aware``        | aggregated: P + D workers of role both, no split                              |
| ``kv-aware+always`` | every prompt to a prefill worker (kvmesh's pick of it), KV sent to the decode worker |
| ``kv-aware+auto``   | the router's decision (router/core/pd.py, the live router's code)             |
| ``kv-aware+dynamic``| the router's decision on P + D workers of role both: any worker may prefill for another (``--pd-mode dynamic``) |
| ``llm-d+pd``        | llm-d's prefix-based P/D decider and its P/D guide's prefill pick             |
| ``dynamo+pd``       | Dynamo's conditional disaggregation rule and its prefill queue                |

What runs is production code: the workers' holds and imports (model_worker/scheduling/kv_holds.py), the
router's decision (router/core/pd.py) and picks. The simulator adds the transfer's time: the blocks the
decode worker lacks, times the model's KV bytes per block, over the link (``--pd-link``), plus a fixed
latency. The link rates, one direction:

- ``nvlink``: 450 GB/s: NVLink 4 on an H100 SXM, 900 GB/s total (NVIDIA H100 Tensor Core GPU datasheet);
- ``rdma``: 50 GB/s: one ConnectX-7 NDR port, 400 Gb/s, per GPU as in a DGX H100 (NVIDIA ConnectX-7 datasheet,
  DGX H100 user guide);
- ``pcie``: 64 GB/s: PCIe 5.0 x16, 32 GT/s per lane, 128b/130b (PCI-SIG PCI Express 5.0 specification);

each with 50 µs per transfer (the NIXL notification and the decode worker's bookkeeping; an assumption,
not a measurement). The transfer does not slow either worker's steps (NIXL reads without the GPU's SMs on
NVLink / RDMA; a PCIe copy engine likewise).

The peers, as their sources have them:

- **llm-d** (llm-d/llm-d-inference-scheduler ``pkg/plugins/profile/prefix_based_pd_decider.go`` @06c08c0, the
  ``pd-profile-handler``; the guide llm-d/llm-d ``guides/pd-disaggregation/gaie-pd/values.yaml`` @126f65d):
  decode-first (its decode profile picks), then split iff the prompt's tokens past the decode pod's prefix
  match are at least ``nonCachedTokens`` (0 = always, the guide's value and the code's default); the guide's
  prefill profile scores by queue only (queue-scorer, max-score picker).
- **Dynamo** (ai-dynamo/dynamo ``examples/llm/components/disagg_router.py`` @02e16f7; the Rust
  ``lib/llm/src/disagg_router.rs`` @3454aa8 has the same length rule): prefill remotely iff
  ``prompt_len * (1 - prefix_hit_rate) > max_local_prefill_length`` (1000) and the prefill queue holds fewer
  than ``max_prefill_queue_size`` (2) requests; prefill workers take requests from that one queue, so the
  least busy one takes it.

Deviations (docs/benchmarks.md lists them with the direction each biases): llm-d's decode pick is the
``llm-d`` policy (precise-prefix profile) where its P/D guide scores decode pods by queue only; Dynamo's
queue is the prefill workers' waiting requests as the router last saw them (reports and its own
view), not a NATS stream's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvmesh.contract.kv_transfer import BOTH, DECODE, PREFILL
from kvmesh.model_worker.engine.kv_legs import KVImport
from kvmesh.replay.records import RequestRecord
from kvmesh.router.core.attempts import Attempts
from kvmesh.router.core.decide import Decided, DecideSequence, Fleet, NoWorker
from kvmesh.router.core.pd import PDDecider, PDDecision
from kvmesh.router.core.plan import RoutePlan
from kvmesh.router.core.policies.base import Candidate, Decision, RouteQuery, queued_prefill, waiting_requests
from kvmesh.sim.config import LINKS, parse_pd
from kvmesh.sim.router import PromptLength, SimRouter
from kvmesh.sim.worker import Attempt

LINK_LATENCY_S = 50e-6

SPLITS = ("always", "auto", "dynamic", "pd")
"""Policy-name suffixes: ``+always``, ``+auto`` (kvmesh's decision), ``+pd`` (the peer's own decider)."""
PEER_DECIDERS = ("llm-d", "dynamo")

HOLD_S = 600.0
"""How long a simulated prefill worker holds a prompt's blocks at most (the decode leg releases them)."""


def parse_policy(name: str) -> tuple[str, str]:
    """``"kv-aware+auto"`` -> ``("kv-aware", "auto")``; no suffix -> ``(name, "")`` (aggregated).
    Raises ValueError on an unknown suffix or a ``+pd`` of a policy without its own decider."""
    base, sep, split = name.partition("+")
    if not sep:
        return name, ""
    if split not in SPLITS:
        raise ValueError(f"policy {name!r}: the P/D suffix must be one of +always, +auto, +dynamic, +pd")
    if split == "pd" and base not in PEER_DECIDERS:
        raise ValueError(f"policy {name!r}: +pd is a peer's own decider ({', '.join(PEER_DECIDERS)}); kvmesh's is "
                         "+auto")
    if split in ("auto", "dynamic") and base != "kv-aware":
        raise ValueError(f"policy {name!r}: +{split} is kvmesh's decision (kv-aware+{split}); a peer's is +pd")
    return base, split


def worker_roles(pd: str, split: str, n: int) -> list[str]:
    """Each worker's role: the first P prefill, the rest decode; all both when aggregated, with +dynamic (every
    worker may prefill for another) or without --pd."""
    if not pd or not split or split == "dynamic":
        return [BOTH] * n
    p, _ = parse_pd(pd)
    return [PREFILL if i < p else DECODE for i in range(n)]


@dataclass(slots=True)
class PDStats:
    """What the split requests did (a run's ``pd`` figures)."""

    decisions: dict[str, int] = field(default_factory=dict)
    split: int = 0
    prefill_failed: int = 0
    blocks_sent: int = 0
    bytes_sent: int = 0
    uncached_bytes: int = 0
    """KV bytes of the decode workers' uncached blocks (the partial last one included) of the split requests."""
    transfer_s: float = 0.0

    def as_dict(self) -> dict:
        return {"decisions": dict(sorted(self.decisions.items())), "split": self.split,
                "prefill_failed": self.prefill_failed, "blocks_sent": self.blocks_sent,
                "bytes_sent": self.bytes_sent,
                "bytes_per_uncached_byte": round(self.bytes_sent / self.uncached_bytes, 6) if self.uncached_bytes else 0.0,
                "transfer_s": round(self.transfer_s, 6)}


class LlmdDecider:
    """llm-d's prefix-based P/D decider and its guide's prefill pick (module docstring)."""

    def __init__(self, non_cached_tokens: int) -> None:
        self.non_cached_tokens = non_cached_tokens

    def decide(self, q: RouteQuery, decode: Candidate, prefills: list[Candidate], decodes=()) -> PDDecision:
        u = max(0, q.prompt_len - decode.indexed_blocks * q.block_size)
        if not prefills:
            return PDDecision(None, "no_prefill_worker", u)
        if self.non_cached_tokens > 0 and u < self.non_cached_tokens:
            return PDDecision(None, "short", u)
        # NOTE: queue-scorer + max-score picker: the fewest waiting requests (first in worker order on a tie)
        best = min(prefills, key=lambda c: (waiting_requests(c), c.worker_id))
        return PDDecision(best.worker_id, "disaggregated", u)


class DynamoDecider:
    """Dynamo's conditional disaggregation (module docstring)."""

    def __init__(self, max_local_prefill_length: int = 1000, max_prefill_queue_size: int = 2) -> None:
        self.max_local = max_local_prefill_length
        self.max_queue = max_prefill_queue_size

    def decide(self, q: RouteQuery, decode: Candidate, prefills: list[Candidate], decodes=()) -> PDDecision:
        hit = min(q.prompt_len, decode.indexed_blocks * q.block_size)
        u = q.prompt_len - hit
        if not prefills:
            return PDDecision(None, "no_prefill_worker", u)
        if u <= self.max_local:
            return PDDecision(None, "short", u)
        if sum(waiting_requests(c) for c in prefills) >= self.max_queue:
            return PDDecision(None, "prefill_busy", u)
        best = min(prefills, key=lambda c: (queued_prefill(c), c.worker_id))
        return PDDecision(best.worker_id, "disaggregated", u)


@dataclass(slots=True)
class _Leg:
    """A split request in flight: its decode pick, waiting for the prefill leg."""

    rec: RequestRecord
    plan: RoutePlan
    decision: Decision
    prefill: str
    ticket: object


class PDSimRouter(SimRouter):
    """A simulated router of a P/D fleet: decode first, then the mode's decision, then the legs."""

    def __init__(self, mesh, index: int, split: str) -> None:
        super().__init__(mesh, index)
        cfg = mesh.cfg
        self.split = split
        self.stats: PDStats = mesh.pd_stats
        base = cfg.routing.policy
        if split == "pd" and base == "llm-d":
            self.decider = LlmdDecider(cfg.llmd_non_cached_tokens)
        elif split == "pd" and base == "dynamo":
            self.decider = DynamoDecider(cfg.dynamo_max_local_prefill, cfg.dynamo_max_prefill_queue)
        else:
            pd = replace(cfg.routing.pd, pd_mode={"always": "always", "dynamic": "dynamic"}.get(split, "auto"))
            self.decider = PDDecider(pd, cost=getattr(self.core.policy, "cost", None),
                                     default_step_tokens=cfg.routing.policy_config.default_step_tokens)
        self._legs: dict[int, _Leg] = {}
        # NOTE: every worker's role, down or up: the fleet splits as it was built (a live router sees the
        # roles of the workers it discovers)
        self._fleet = Fleet({w.worker_id: w.role for w in mesh.workers},
                            "dynamic" if split == "dynamic" else "always")

    def sequence(self, rec: RequestRecord) -> DecideSequence:
        """The live router's decide sequence, with the fleet's roles and this mode's decider."""
        return DecideSequence(self.core, self.spec, PromptLength(rec.prompt_len), self.workers.endpoints,
                              request_id=f"r{rec.index}.{rec.attempts + 1}", max_tokens=rec.output_len,
                              objectives=self.mesh.objectives, chain=self.mesh.chains[rec.index],
                              adapter=self.mesh.workload.requests[rec.index].adapter,
                              healthy=self.workers.healthy, fleet=self._fleet, decider=self.decider)

    def no_worker(self, exc: NoWorker) -> str:
        return "no decode worker"

    def _decided(self, rec: RequestRecord, decided: Decided, delay: float) -> None:
        pd = decided.pd
        assert pd is not None, "a P/D fleet's sequence always decides"
        plan, decision = decided.plan, decided.decision
        s = self.stats
        s.decisions[pd.reason] = s.decisions.get(pd.reason, 0) + 1
        if pd.prefill_worker is None:
            super()._decided(rec, decided, delay)
            return
        # NOTE: the prefill leg, under its own record (its token is not the client's first token)
        q = plan.query
        c = next(c for c in plan.prefill_candidates if c.worker_id == pd.prefill_worker)
        ticket = self.core.inflight.start(pd.prefill_worker, max(0, q.prompt_len - c.matched_blocks * q.block_size),
                                          -(-q.prompt_len // q.block_size))
        shadow = RequestRecord(rec.index, rec.arrival, rec.prompt_len, 1)
        attempts = Attempts(self.core, plan, decision, 1, rec.arrival + self.mesh.cfg.routing.request_timeout_s,
                            self.workers.mark_unhealthy)
        a = Attempt(shadow, self, attempts, ticket, f"r{rec.index}.p")
        self._legs[id(a)] = _Leg(rec, plan, decision, pd.prefill_worker, ticket)
        worker = self.mesh.workers_by_id[pd.prefill_worker]
        self.mesh.forward(delay + self.mesh.cfg.network_s, worker.submit, a, 1, HOLD_S, None)

    # -- the prefill leg's end (the worker calls these) ---------------------------------------------
    def first_token(self, a: Attempt) -> None:
        if id(a) not in self._legs:
            super().first_token(a)

    def finished(self, a: Attempt) -> None:
        leg = self._legs.pop(id(a), None)
        if leg is None:
            super().finished(a)
            return
        self.core.inflight.finish(leg.ticket)  # type: ignore[arg-type]
        self.stats.split += 1
        # NOTE: the decode leg goes out now; it reaches the decode worker a hop later, which then pulls
        self.mesh.q.after(self.mesh.cfg.network_s, self._pull, leg)

    def worker_failed(self, a: Attempt, worker_id: str) -> None:
        leg = self._legs.pop(id(a), None)
        if leg is None:
            super().worker_failed(a, worker_id)
            return
        self.core.inflight.finish(leg.ticket)  # type: ignore[arg-type]
        self.stats.prefill_failed += 1
        self.workers.mark_unhealthy(worker_id)
        self._local(leg)

    def refused(self, a: Attempt, why: str) -> None:
        leg = self._legs.pop(id(a), None)
        if leg is None:
            super().refused(a, why)
            return
        self.core.inflight.finish(leg.ticket)  # type: ignore[arg-type]
        # NOTE: what the prefill worker refuses (longer than max_model_len) every worker refuses
        leg.rec.failed = f"refused: {why}"
        self.mesh.request_done(leg.rec)

    def _local(self, leg: _Leg) -> None:
        """The prefill leg failed: the decode worker prefills the prompt itself."""
        attempts = Attempts(self.core, leg.plan, leg.decision, self.mesh.cfg.routing.max_attempts,
                            leg.rec.arrival + self.mesh.cfg.routing.request_timeout_s, self.workers.mark_unhealthy)
        self._send(leg.rec, attempts, 0.0)

    def _pull(self, leg: _Leg) -> None:
        """The decode leg at the decode worker: it pulls the blocks it lacks; the leg joins its engine when they
        arrived, and the prefill worker's hold ends."""
        mesh = self.mesh
        decode = mesh.workers_by_id[leg.decision.worker_id]
        prefill = mesh.workers_by_id[leg.prefill]
        rid = f"r{leg.rec.index}.p"
        if not decode.up or decode.engine is None or not prefill.up or prefill.engine is None:
            if prefill.up and prefill.engine is not None:
                prefill.engine.kv_holds.release(rid)
            self._local(leg)
            return
        hold = prefill.engine.kv_holds.holds.get(rid)
        hashes = list(hold.block_hashes) if hold is not None else []
        start = decode.engine.kv_holds.leading_cached(hashes)
        n = max(0, len(hashes) - start)
        q = leg.plan.query
        per_block = mesh.cfg.cost_for(decode.gpu).kv_bytes_per_token * q.block_size
        sent = n * per_block
        uncached = max(0, -(-q.prompt_len // q.block_size) - start) * per_block
        s = self.stats
        s.blocks_sent += n
        s.bytes_sent += sent
        s.uncached_bytes += uncached
        dt = (LINK_LATENCY_S + sent / LINKS[mesh.cfg.pd_link]) if n else 0.0
        s.transfer_s += dt
        mesh.q.after(dt, self._decode_leg, leg, rid, hashes, start, n)

    def _decode_leg(self, leg: _Leg, rid: str, hashes: list[bytes], start: int, n: int) -> None:
        mesh = self.mesh
        prefill = mesh.workers_by_id[leg.prefill]
        if prefill.up and prefill.engine is not None:
            prefill.engine.kv_holds.release(rid)
        attempts = Attempts(self.core, leg.plan, leg.decision, mesh.cfg.routing.max_attempts,
                            leg.rec.arrival + mesh.cfg.routing.request_timeout_s, self.workers.mark_unhealthy)
        decision = attempts.next(mesh.q.now)
        if decision is None:
            leg.rec.failed = "no decode worker could take it"
            mesh.request_done(leg.rec)
            return
        ticket = self.core.start(leg.plan, decision.worker_id)
        rec = leg.rec
        rec.attempts += 1
        rec.worker = decision.worker_id
        kv = KVImport(hashes[:start + n], start, None, num_blocks=n) if n and decision.worker_id == leg.decision.worker_id \
            else None
        a = Attempt(rec, self, attempts, ticket, f"r{rec.index}.{rec.attempts}", kv)
        mesh.workers_by_id[decision.worker_id].submit(a, None, None, kv)
