"""The attempts of one request: which worker to try, and what a failure before the first token means.

The first pick, then after a worker fails before the first token the next pick among the
candidates not tried yet, until ``max_attempts`` workers were tried or the deadline passed. A
worker that is down is marked unhealthy (skipped for a while by every request); a request the
worker refuses as bad is never retried (every worker would refuse it); a failure that is not
known to be transient (a worker bug) is not retried either (it would likely repeat).

Transport-free: the live request path (router/model_router.py) and the simulator (kvmesh/sim/mesh.py)
both drive it, so retries, health marks, the attempt limit and the deadline are one code.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

from collections.abc import Callable

from kvmesh.contract.errors import InvalidArgument, KVMeshError, ResourceExhausted, Unavailable
from kvmesh.router.core.plan import RoutePlan
from kvmesh.router.core.policies.base import Decision
from kvmesh.router.core.routing import RoutingCore
from kvmesh.router.core.upstream import RETRIABLE, Failure


class Attempts:
    """Args:
    core: the router's decision state (picks are recorded in its speculative map).
    plan: the request's candidates.
    first: the first pick, made before (router/model_router.py times the decision path with it).
    max_attempts: workers tried at most (``--max-attempts``).
    deadline: monotonic seconds after which no worker is tried.
    mark_unhealthy: the worker set's health mark.
    """

    def __init__(self, core: RoutingCore, plan: RoutePlan, first: Decision, max_attempts: int, deadline: float,
                 mark_unhealthy: Callable[[str], None]) -> None:
        self.core = core
        self.plan = plan
        self.max_attempts = max_attempts
        self.deadline = deadline
        self._mark_unhealthy = mark_unhealthy
        self._first: Decision | None = first
        self._remaining = list(plan.candidates)
        self.tried = 0
        self.failures: list[tuple[str, Failure, str]] = []
        """(worker id, failure, message) of every failed attempt, in order."""

    def next(self, now: float) -> Decision | None:
        """The next worker to try; None when the attempts, the candidates or the time ran out."""
        if self.tried >= self.max_attempts or not self._remaining or now >= self.deadline:
            return None
        if self._first is not None:
            decision, self._first = self._first, None
        else:
            decision = self.core.pick(self.plan, self._remaining)
        self.tried += 1
        self._remaining = [c for c in self._remaining if c.worker_id != decision.worker_id]
        return decision

    def failed(self, worker_id: str, failure: Failure, message: str = "", details: str = "") -> bool:
        """A worker failed before the first token; True when the next one should be tried.

        Raises:
            InvalidArgument: the worker refused the request as bad (``details``: its words).
        """
        if failure is Failure.INVALID:
            raise InvalidArgument(details or message)
        self.failures.append((worker_id, failure, message))
        if failure not in RETRIABLE:
            return False
        if failure is Failure.UNAVAILABLE:
            self._mark_unhealthy(worker_id)
        return True

    def error(self) -> KVMeshError:
        """What the client gets when no worker took the request."""
        n = len(self.failures)
        kinds = ", ".join(f.value for _, f, _ in self.failures) or "the deadline passed"
        if self.failures and all(f is Failure.BUSY for _, f, _ in self.failures):
            return ResourceExhausted(f"every worker tried is at capacity ({n} attempt(s)): retry later")
        return Unavailable(f"no worker could take the request after {n} attempt(s) ({kinds}): retry later")
