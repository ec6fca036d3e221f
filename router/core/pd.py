"""Prefill/decode disaggregation, the router's decision: decode-first, then whether a prefill worker
takes the prompt, and which (docs/router.md, "Prefill/decode disaggregation").

1. **Decode first.** The routing policy picks the decode worker among the workers that decode
   (role ``decode`` or ``both``), cache-aware as for any request: the decode worker is where the
   request lives longest, and its prefix cache decides what must travel.
2. **Does a prefill worker pay?** The prompt's uncached part is prefilled either on the decode
   worker (``local``) or on a prefill worker and sent over (``remote``). Both are predicted in
   seconds with the step costs the router learned from each worker's reports
   (router/core/policies/cost.py, kv-aware's prediction, router/core/policies/kv_aware.py):

       local  = ttft_d(u_d) + k_d * own_d(u_d) + harm_d(u_d)
       remote = ttft_p(u_p) + k_p * own_p(u_p) + harm_p(u_p) + link_d(blocks_sent) + ttft_d(tail) + k_d * own_d(tail) + harm_d(tail)
       k_pool = pd_work_weight * (1 + the mean requests waiting per worker of that pool)
       harm_w(u) = pd_harm_weight * D_w * steps * max(0, own_w(u) / steps - pd_itl_target)

   ``k_pool * own`` the capacity a prefill takes from its pool (kv-aware's work term: a backlogged decode pool
   hands prompts to an idle prefill pool, an idle one keeps them), ``u_d`` / ``u_p`` the prompt tokens the
   decode / prefill worker lacks, ``D_w`` the requests decoding
   on worker w (each one waits for every step of a prefill there: the inter-token latency the split
   protects; only what a step takes beyond the operator's ITL target, ``--pd-itl-target``, harms them;
   a prefill worker of role prefill decodes none), ``steps`` the prefill's chunks, ``blocks_sent`` the reusable blocks the decode worker lacks, ``link_d`` what sending them
   costs, ``fixed + per_block * blocks`` (fitted over the decode legs' pulls: each answer carries the
   pull's blocks and time; 0 until one was seen), ``tail`` the prompt's last partial block and last token, which every
   engine computes itself. The decode leg disaggregates iff ``remote < local``. So the threshold is
   not a constant: it is the prompt length at which the prediction tips, for this decode worker's
   load and the learned coefficients (:meth:`PDDecider.threshold`, a metric).
3. **The prefill worker** is the one (among role ``prefill``) with the least ``ttft_p + link``: cache-
   and load-aware by the same prediction. A busy prefill pool shows as its queue in ``ttft_p``, so a
   split that would pay on an idle prefill worker and does not now is ``prefill_busy``.

Before the step costs are learned (the first reports of a fresh mesh), the rule runs in token units
with the transfer free, and only a prompt of ``pd_cold_min_tokens`` uncached tokens or more is split.

Pure: no grpc, no redis, no clock; the live router (router/model_router.py) and the simulator
(kvmesh/sim/pd.py) call it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvmesh.contract.kv_transfer import PREFILL, serves_decode, serves_prefill
from kvmesh.contract.settings import flag
from kvmesh.router.core.policies.base import Candidate, RouteQuery, queued_prefill, waiting_requests
from kvmesh.router.core.policies.cost import StepCost, StepCostLearner, per_worker
from kvmesh.router.core.policies.kv_aware import NOMINAL_COST, decoders, predicted_ttft

PD_MODES = ("auto", "dynamic", "always", "never")


@dataclass(slots=True)
class PDConfig:
    """The router's prefill/decode settings: one declaration for the live router and the simulator."""

    pd_mode: str = flag("auto", metavar="auto|dynamic|always|never")
    """With prefill and decode workers in the fleet: auto = the router decides per request whether a prefill
    worker takes the prompt (docs/router.md, "Prefill/decode disaggregation"); always = every request's prompt goes
    to a prefill worker; never = decode workers prefill every prompt themselves. dynamic = auto where any worker
    that prefills (role prefill or both) may take another's prompt: a fleet of role-both workers splits requests
    when it pays."""
    pd_harm_weight: float = 1.0
    """auto: weight of the delay a local prefill adds to each request decoding on the decode worker (the inter-token
    latency the split protects), against this request's own time to first token."""
    pd_work_weight: float = 0.0
    """auto: weight of the work a prefill takes from its pool (the capacity it costs: kv-aware's work term), times
    one plus the mean requests waiting at that pool's workers: a backlogged decode pool hands prompts to an idle
    prefill pool, an idle one keeps them."""
    pd_itl_target: float = 0.0
    """auto: seconds a decode step may take before the requests decoding in it are harmed (the operator's ITL
    target); a local prefill's harm is what its steps take beyond it. 0 = every second of the prefill counts."""
    pd_cold_min_tokens: int = 1024
    """auto, until the workers' step costs are learned: split a prompt when the decode worker lacks at least this
    many of its tokens (then the learned prediction decides)."""

    def check(self) -> None:
        if self.pd_mode not in PD_MODES:
            raise ValueError(f"--pd-mode must be one of {', '.join(PD_MODES)}, got {self.pd_mode!r}")
        if min(self.pd_harm_weight, self.pd_cold_min_tokens, self.pd_itl_target, self.pd_work_weight) < 0:
            raise ValueError("--pd-harm-weight, --pd-work-weight, --pd-itl-target and --pd-cold-min-tokens must be >= 0")


@dataclass(slots=True, frozen=True)
class PDDecision:
    """Whether (and where) a request's prompt is prefilled apart from its decode worker, and why."""

    prefill_worker: str | None
    """The prefill worker, or None: the decode worker prefills the prompt itself."""
    reason: str
    """disaggregated, short (not worth a transfer at this length and load), prefill_busy (it would be on an idle
    prefill worker), cached (the decode worker holds the reusable prompt), no_prefill_worker, mode (--pd-mode
    always / never), cold_short (costs not learned yet, under --pd-cold-min-tokens)."""
    uncached_tokens: int = 0
    """Prompt tokens the decode worker lacks."""
    local_s: float = 0.0
    remote_s: float = 0.0
    """The two predictions (seconds; token units while cold)."""
    blocks_sent: int = 0
    """Blocks that would travel (the reusable blocks the decode worker lacks)."""


def reusable_blocks(q: RouteQuery) -> int:
    """A prompt's full blocks an engine can take over: all but the block of its last token."""
    return max(0, (q.prompt_len - 1) // q.block_size) if q.block_size else 0


class _LinkFit:
    """seconds = fixed + per_block * blocks, by least squares with forgetting (both >= 0)."""

    __slots__ = ("n", "b", "bb", "s", "bs", "reports")

    def __init__(self) -> None:
        self.n = self.b = self.bb = self.s = self.bs = 0.0
        self.reports = 0

    def add(self, blocks: float, seconds: float, forget: float) -> None:
        self.n = forget * self.n + 1
        self.b = forget * self.b + blocks
        self.bb = forget * self.bb + blocks * blocks
        self.s = forget * self.s + seconds
        self.bs = forget * self.bs + blocks * seconds
        self.reports += 1

    def solve(self) -> tuple[float, float]:
        det = self.n * self.bb - self.b * self.b
        if det > 1e-9 * max(1.0, self.n * self.bb):
            per = (self.n * self.bs - self.b * self.s) / det
            fixed = (self.s - per * self.b) / self.n
            if per >= 0 and fixed >= 0:
                return fixed, per
        # NOTE: one size of transfer seen (or a fit below zero): all of it per block, no fixed part
        return 0.0, (self.s / self.b if self.b else 0.0)


class TransferLink:
    """What a transfer to a decode worker costs: ``fixed + per_block * blocks`` seconds, fitted over its pulls
    (each decode leg's answer carries the pull's blocks and seconds), per decode worker and pooled. The fixed
    part is what a split costs whatever its size (the handshake, the release, the bookkeeping). Thread-safe."""

    MIN_REPORTS = 2

    def __init__(self, forget: float = 0.98) -> None:
        self.forget = forget
        self._fits: dict[str, _LinkFit] = {}
        self._pooled = _LinkFit()
        self._lock = threading.Lock()

    def observe(self, decode_worker: str, blocks: int, seconds: float) -> None:
        if blocks <= 0 or seconds < 0:
            return
        with self._lock:
            for f in (self._fits.setdefault(decode_worker, _LinkFit()), self._pooled):
                f.add(blocks, seconds, self.forget)

    def cost(self, decode_worker: str, blocks: int) -> float:
        """Seconds to send ``blocks`` blocks to the worker: its own fit once it has MIN_REPORTS pulls, else the
        pooled one; 0 before any pull."""
        with self._lock:
            f = self._fits.get(decode_worker)
            if f is None or f.reports < self.MIN_REPORTS:
                f = self._pooled
            if not f.reports:
                return 0.0
            fixed, per = f.solve()
        return fixed + per * blocks

    def seconds_per_block(self, decode_worker: str) -> float:
        """The marginal seconds per block (the fit's slope)."""
        with self._lock:
            f = self._fits.get(decode_worker)
            f = f if f is not None and f.reports >= self.MIN_REPORTS else self._pooled
            return f.solve()[1] if f.reports else 0.0


class PDDecider:
    """The decision of step 2-3 above, on the router's learned step costs.

    Args:
        config: the P/D settings.
        cost: the step costs (the kv-aware policy's learner when it routes, so both read one fit).
        default_step_tokens: a worker's token budget per step when its load does not say.
    """

    def __init__(self, config: PDConfig | None = None, cost: StepCostLearner | None = None,
                 default_step_tokens: int = 2048) -> None:
        self.config = config or PDConfig()
        self.cost = cost if cost is not None else StepCostLearner(group=per_worker)
        self._own_cost = cost is None
        self.link = TransferLink()
        self.default_step_tokens = default_step_tokens
        self.last_threshold: int | None = None
        """The prompt length (uncached tokens) at which the last auto decision would tip, at an idle
        prefill worker (a gauge)."""

    def observe(self, candidates: Sequence[Candidate]) -> None:
        """Feeds the candidates' load reports to the step-cost fit (when it is the decider's own)."""
        if self._own_cost:
            for c in candidates:
                self.cost.observe(c.worker_id, c.load)

    def _model(self, worker_id: str) -> StepCost:
        return (self.cost.estimate(worker_id) or NOMINAL_COST) if self.cost.learned else NOMINAL_COST

    def _harm(self, q: RouteQuery, c: Candidate, own: float, held_blocks: int) -> float:
        """What a prefill of ``own`` seconds on ``c`` costs the requests decoding there: each waits for every step
        of it, beyond ``pd_itl_target`` a step (``harm`` x decoders x steps x excess). A step also carries the
        prefills queued ahead (up to the budget): its time is this prefill's share scaled to the step's tokens."""
        u = max(0, q.prompt_len - held_blocks * q.block_size)
        budget = c.load.max_num_batched_tokens or self.default_step_tokens
        steps = max(1, -(-u // budget))
        # NOTE: only against a target: without one, every second of this prefill counts once, whatever shares its steps
        fill = min(budget, queued_prefill(c) + u) / max(1, min(budget, u)) if self.config.pd_itl_target else 1.0
        excess = max(0.0, own / steps * fill - self.config.pd_itl_target)
        return self.config.pd_harm_weight * decoders(c) * steps * excess

    def predict(self, q: RouteQuery, decode: Candidate, prefill: Candidate, backlog: tuple[float, float] = (0.0, 0.0)
                ) -> tuple[float, float, int]:
        """(local, remote, blocks sent) for this decode worker and prefill worker (see the module); ``backlog``: the
        mean requests waiting per worker of the decode pool and of the prefill pool."""
        md, mp = self._model(decode.worker_id), self._model(prefill.worker_id)
        step = self.default_step_tokens
        kd, kp = (self.config.pd_work_weight * (1.0 + b) for b in backlog)
        ttft_l, own_l = predicted_ttft(md, q, decode, step)
        local = ttft_l + kd * own_l + self._harm(q, decode, own_l, decode.matched_blocks + decode.host_blocks)
        reusable = reusable_blocks(q)
        sent = max(0, reusable - decode.matched_blocks)
        ttft_p, own_p = predicted_ttft(mp, q, prefill, step)
        # NOTE: a prefill worker that decodes requests of its own (role both, --pd-mode dynamic) stalls them
        ttft_p += kp * own_p + self._harm(q, prefill, own_p, prefill.matched_blocks + prefill.host_blocks)
        # NOTE: the decode leg's own part: the prompt's tail past the blocks it then holds, behind its queue
        tail = replace(decode, matched_blocks=max(decode.matched_blocks, reusable), host_blocks=0)
        ttft_t, own_t = predicted_ttft(md, q, tail, step)
        link = self.link.cost(decode.worker_id, sent) if self.cost.learned and sent else 0.0
        remote = ttft_p + link + ttft_t + kd * own_t + self._harm(q, tail, own_t, tail.matched_blocks)
        return local, remote, sent

    def decide(self, q: RouteQuery, decode: Candidate, prefills: Sequence[Candidate],
               decodes: Sequence[Candidate] = ()) -> PDDecision:
        """Where the prompt of a request whose decode worker is ``decode`` is prefilled (``decodes``: the pool it
        was picked from, for its backlog)."""
        cfg = self.config
        self.observe([decode, *prefills])
        u = max(0, q.prompt_len - (decode.matched_blocks + decode.host_blocks) * q.block_size)
        reusable = reusable_blocks(q)
        if cfg.pd_mode == "never":
            return PDDecision(None, "mode", u)
        if not prefills:
            return PDDecision(None, "no_prefill_worker", u)
        if decode.matched_blocks >= reusable:
            return PDDecision(None, "cached", u)
        prefills = [p for p in prefills if p.worker_id != decode.worker_id]
        if not prefills:
            return PDDecision(None, "no_prefill_worker", u)
        pool = list(decodes) or [decode]
        backlog = (sum(waiting_requests(c) for c in pool) / len(pool),
                   sum(waiting_requests(c) for c in prefills) / len(prefills))
        scored = [(self.predict(q, decode, p, backlog), p) for p in prefills]
        (local, remote, sent), best = min(scored, key=lambda s: (s[0][1], s[1].worker_id))
        if cfg.pd_mode == "always":
            return PDDecision(best.worker_id, "mode", u, local, remote, sent)
        if not self.cost.learned:
            if u >= cfg.pd_cold_min_tokens:
                return PDDecision(best.worker_id, "disaggregated", u, local, remote, sent)
            return PDDecision(None, "cold_short", u, local, remote, sent)
        if remote < local:
            return PDDecision(best.worker_id, "disaggregated", u, local, remote, sent)
        idle = replace(best, load=replace(best.load, queued_prefill_tokens=0, prefilling_tokens=0, num_waiting=0,
                                          num_running=0),
                       inflight_prefill_tokens=0, inflight_waiting=0, inflight_requests=0,
                       pending=replace(best.pending, requests=0, prefill_tokens=0, blocks=0))
        idle_local, idle_remote, _ = self.predict(q, decode, idle, (backlog[0], 0.0))
        reason = "prefill_busy" if idle_remote < idle_local else "short"
        return PDDecision(None, reason, u, local, remote, sent)

    def threshold(self, q: RouteQuery, decode: Candidate, prefill: Candidate) -> int:
        """The smallest prompt length (tokens, this decode worker holding none of it) at which a split to an
        idle ``prefill`` worker pays, by bisection; the prompt's own length + 1 when none up to it does."""
        idle = replace(prefill, load=replace(prefill.load, queued_prefill_tokens=0, prefilling_tokens=0,
                                             num_waiting=0, num_running=0),
                       matched_blocks=0, inflight_prefill_tokens=0, inflight_waiting=0, inflight_requests=0)
        cold = replace(decode, matched_blocks=0, host_blocks=0)

        def pays(n: int) -> bool:
            local, remote, _ = self.predict(replace(q, prompt_len=n), cold, idle)
            return remote < local

        hi = max(q.prompt_len, 2 * q.block_size)
        if not pays(hi):
            self.last_threshold = hi + 1
            return hi + 1
        lo = 1
        while lo < hi:
            mid = (lo + hi) // 2
            if pays(mid):
                hi = mid
            else:
                lo = mid + 1
        self.last_threshold = lo
        return lo


def split_roles(candidates: Sequence[Candidate], roles: dict[str, str],
                dynamic: bool = False) -> tuple[list[Candidate], list[Candidate]]:
    """(the workers that decode, the prefill workers) of a plan's candidates, by their registered role; with
    ``dynamic`` every worker that prefills (prefill or both) is a prefill worker too."""
    decode = [c for c in candidates if serves_decode(roles.get(c.worker_id, "both"))]
    prefill = [c for c in candidates if (serves_prefill if dynamic else _is_prefill)(roles.get(c.worker_id, "both"))]
    return decode, prefill


def _is_prefill(role: str) -> bool:
    return role == PREFILL


def disaggregated_fleet(roles: Sequence[str], mode: str = "auto") -> bool:
    """Whether a model's requests go through the P/D decision: a prefill worker and a worker that decodes (with
    --pd-mode never too: prefill workers then take no request), or (``dynamic``) two workers at least."""
    if mode == "dynamic":
        return len(roles) >= 2
    return PREFILL in roles and any(serves_decode(r) for r in roles)
