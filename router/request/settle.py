"""What a finished request leaves behind: the miss audit (router/core/audit.py), the P/D link's learning and
counts, the one log line that says how it ended."""

from __future__ import annotations

import logging

from kvmesh.contract.types import Usage
from kvmesh.router.core.audit import MissAudit, predicted_blocks
from kvmesh.router.core.pd import TransferLink
from kvmesh.router.core.plan import RoutePlan
from kvmesh.router.core.upstream import WorkerChunk
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.request.context import RequestContext

log = logging.getLogger("kvmesh.router")


class Settle:
    """Args:
    audit: the miss audit's window.
    metrics: where to count.
    link: the P/D transfer link's learner (router/core/pd.py).
    """

    def __init__(self, audit: MissAudit, metrics: RouterMetrics, link: TransferLink) -> None:
        self.audit_window = audit
        self.metrics = metrics
        self.link = link

    def audit(self, plan: RoutePlan, worker_id: str, usage: Usage | None, pulled_blocks: int = 0) -> None:
        """The index's prediction for the worker that served against the engine's cached tokens (less the
        blocks a decode leg pulled from a prefill worker: those the index could not predict, no miss)."""
        if not plan.answered or usage is None or not usage.prompt_tokens:
            return
        bs = plan.query.block_size
        c = plan.candidate(worker_id)
        predicted = predicted_blocks(c.indexed_blocks, len(plan.token_ids), bs, c.load.cache_block_tokens)
        cached = usage.cached_tokens // bs - pulled_blocks
        self.metrics.audited(worker_id, predicted, cached)
        alarm = self.audit_window.observe(worker_id, predicted, cached)
        if alarm is not None:
            log.warning("miss audit: %s", alarm.message())

    def decode_leg(self, ctx: RequestContext, worker_id: str, chunk: WorkerChunk) -> Usage | None:
        """A decode leg's last chunk: how its KV came, learned (the link) and counted; the usage the client
        sees (what the mesh's caches served is what the prefill worker's cache served)."""
        transport = chunk.kv_transport or "local"
        self.metrics.pd_transfers.labels(transport).inc()
        if chunk.kv_blocks_pulled:
            self.link.observe(worker_id, chunk.kv_blocks_pulled, chunk.kv_pull_s)
        leg = ctx.prefill
        usage = chunk.usage
        if leg is not None:
            leg.taken = True
            leg.transfer = f"{transport} {chunk.kv_blocks_pulled} blocks"
            if usage is not None and chunk.kv_blocks_pulled:
                # NOTE: the pulled blocks were computed for this request (on the prefill worker)
                usage = Usage(usage.prompt_tokens, leg.cached_tokens, usage.completion_tokens)
        return usage

    def log(self, ctx: RequestContext, finish: str, served_by: str, usage: Usage | None) -> None:
        u = usage or Usage()
        d, pd = ctx.tried, ctx.decided.pd if ctx.decided is not None else None
        how = (f", P/D {pd.reason}" + (f" via {ctx.prefill.worker_id}, KV {ctx.prefill.transfer or 'not taken'}"
                                       if ctx.prefill is not None else "")) if pd is not None else ""
        matched = ctx.plan.candidate(d.worker_id).matched_blocks if d is not None else None
        log.info("request %s: %s on %s (%s, %s of %s blocks matched%s): prompt %d cached %d completion %d tokens",
                 ctx.request_id, finish, served_by, d.reason if d is not None else None, matched,
                 len(ctx.plan.query.block_hashes), how, u.prompt_tokens, u.cached_tokens, u.completion_tokens)
