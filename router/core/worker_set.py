"""One model's workers as the router knows them: the set discovery last saw and the health marks.

Transport-free: the live pool (router/workers/worker_pool.py) and the simulator's routers
(kvmesh/sim/mesh.py) both keep theirs here, on their own clock.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvmesh.contract.types import ModelSpec
from kvmesh.router.core.upstream import WorkerEndpoint

EMPTY_GRACE_S = 5.0
"""How long an index that suddenly lists none of the model's workers is doubted (the last set kept)."""


class WorkerSet:
    """Args:
    unhealthy_s: how long a worker that failed a call is skipped (``--unhealthy-time``).
    discovers_from_index: the set comes from the kv_service (an empty answer may be a Redis that
        restarted: doubted for ``empty_grace_s``); False for a static ``--workers`` list.
    clock: monotonic seconds (the simulator's virtual clock).
    """

    def __init__(self, unhealthy_s: float, discovers_from_index: bool = True,
                 clock: Callable[[], float] = time.monotonic, empty_grace_s: float = EMPTY_GRACE_S) -> None:
        self.unhealthy_s = unhealthy_s
        self.discovers_from_index = discovers_from_index
        self.empty_grace_s = empty_grace_s
        self._clock = clock
        self.endpoints: list[WorkerEndpoint] = []
        """The live workers (replaced, never mutated: a request that read the list keeps a consistent one)."""
        self.spec: ModelSpec | None = None
        self.problem = ""
        """Why the set is empty or stale (shown in UNAVAILABLE messages: no addresses in it)."""
        self._unhealthy: dict[str, float] = {}
        self._empty_since: float | None = None

    def update(self, endpoints: list[WorkerEndpoint], spec: ModelSpec | None = None, problem: str = "") -> None:
        """The model's live workers of the last poll (``spec`` None: keep the last one)."""
        if spec is not None:
            self.spec = spec
        self.problem = problem
        if not endpoints and self.endpoints and self.discovers_from_index:
            # NOTE: a Redis that restarted empty lists no worker until each one's next heartbeat
            # gets NOT_FOUND and it registers again (a third of a lease). Dropping every worker at
            # once would fail every request in that window; a worker that really died fails its
            # requests as UNAVAILABLE (retried elsewhere) either way.
            now = self._clock()
            self._empty_since = self._empty_since if self._empty_since is not None else now
            if now - self._empty_since < self.empty_grace_s:
                return
        self._empty_since = None
        self.endpoints = endpoints

    def set_problem(self, problem: str) -> None:
        """The source failed: keep the last good set, say why it may be stale."""
        self.problem = problem

    def healthy(self, worker_id: str) -> bool:
        until = self._unhealthy.get(worker_id)
        return until is None or self._clock() >= until

    def mark_unhealthy(self, worker_id: str) -> None:
        self._unhealthy[worker_id] = self._clock() + self.unhealthy_s
