"""The miss audit: what the index predicted each request would find cached, against what the engine used.

On every request the router knows how many leading blocks the index said the chosen worker holds
(the Lookup's ``matched_blocks`` of that worker, not the speculative map's guesses), and the engine
reports the prompt's ``cached_tokens`` at the end. Nothing else compares the two: a bridged engine
whose event stream stopped, a worker hashing under another root (model id, seed) or evictions the
index never heard of all look like an index that works (docs/router.md, "Miss audit").

Per request the prediction is capped at what an engine can reuse (the prompt less its last token:
every engine computes that one). A **silent miss** is a prediction at least one block above the
engine's count (the index holds blocks the engine does not); an **unseen hit** one at least one
block below (the engine caches under hashes the index is not asked for). :class:`MissAudit` keeps,
per worker, the totals since the last report to the kv_service and a window of the last requests;
it says when a worker's silent-miss or unseen-hit rate over a full window passes the threshold, once
per window.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvmesh.contract.index_protocol import WorkerAudit


@dataclass(slots=True, frozen=True)
class AuditAlarm:
    """A worker's mismatch rate over its last ``window`` requests passed the threshold."""

    worker_id: str
    kind: str
    """silent_miss (the index predicted more than the engine used) or unseen_hit (less)."""
    count: int
    window: int

    def message(self) -> str:
        if self.kind == "silent_miss":
            return (f"worker {self.worker_id}: {self.count} of its last {self.window} requests found at least one "
                    "block fewer cached than the index said it holds (silent misses): is its event stream "
                    "alive (a bridge's engine events), are its evictions reported? (kvmesh admin audit; "
                    "--audit-miss-rate)")
        return (f"worker {self.worker_id}: {self.count} of its last {self.window} requests found at least one block "
                "more cached than the index said it holds (unseen hits): does it hash blocks as the router does "
                "(model id, hash algorithm, block size)? (kvmesh admin audit; --audit-miss-rate)")


def predicted_blocks(indexed_blocks: int, prompt_len: int, block_size: int, engine_block_tokens: int = 0) -> int:
    """The index's prediction of a request's cached blocks, capped at what the engine can reuse: the
    prompt less its last token, in whole blocks of the engine's own (``engine_block_tokens``, when
    coarser than the index's: a vLLM of block 32 behind a bridge reuses 64 of a 96-token prompt)."""
    if not block_size:
        return 0
    step = max(block_size, engine_block_tokens)
    return min(indexed_blocks, max(0, prompt_len - 1) // step * step // block_size)


class MissAudit:
    """Per worker: audit totals since the last :meth:`take`, and a window of the last requests.

    Args:
        window: requests per worker the alarm's rate is taken over.
        rate: the alarm threshold (0 = no alarm).
    """

    def __init__(self, window: int = 64, rate: float = 0.25) -> None:
        self.window = window
        self.rate = rate
        self._totals: dict[str, WorkerAudit] = {}
        # worker -> (last outcomes: 1 silent miss, -1 unseen hit, 0 agreed; requests until the next alarm may sound)
        self._recent: dict[str, tuple[deque[int], list[int]]] = {}

    def observe(self, worker_id: str, predicted: int, cached: int) -> AuditAlarm | None:
        """One request served by ``worker_id``; an alarm when the window's rate just passed the threshold."""
        self._totals.setdefault(worker_id, WorkerAudit()).observe(predicted, cached)
        outcome = 1 if predicted >= cached + 1 else -1 if cached >= predicted + 1 else 0
        recent, quiet = self._recent.setdefault(worker_id, (deque(maxlen=self.window), [0]))
        recent.append(outcome)
        quiet[0] = max(0, quiet[0] - 1)
        if not self.rate or len(recent) < self.window or quiet[0]:
            return None
        for kind, sign in (("silent_miss", 1), ("unseen_hit", -1)):
            n = sum(1 for o in recent if o == sign)
            if n >= self.rate * self.window:
                quiet[0] = self.window  # NOTE: once per window, not once per request while it lasts
                return AuditAlarm(worker_id, kind, n, self.window)
        return None

    def take(self) -> dict[str, WorkerAudit]:
        """The totals since the last take (what a report to the kv_service carries)."""
        out, self._totals = self._totals, {}
        return out

    def forget(self, keep: set[str]) -> None:
        """Drops the windows of workers not in ``keep`` (they left)."""
        for w in [w for w in self._recent if w not in keep]:
            del self._recent[w]
