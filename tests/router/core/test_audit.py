"""The miss audit's core (router/core/audit.py): counts, the cap on a prediction, the windowed alarm."""

from __future__ import annotations

from kvmesh.contract.index_protocol import WorkerAudit
from kvmesh.router.core.audit import MissAudit, predicted_blocks


def test_a_prediction_is_capped_at_what_an_engine_can_reuse():
    # A prompt of exactly 4 blocks of 16: every engine recomputes its last token, so 3 blocks at most.
    assert predicted_blocks(4, 64, 16) == 3
    assert predicted_blocks(4, 65, 16) == 4 and predicted_blocks(2, 65, 16) == 2 and predicted_blocks(9, 1, 16) == 0
    # A bridged vLLM of block 32 (the index in blocks of 16): of 96 tokens it reuses 64, not 80.
    assert predicted_blocks(6, 96, 16, 32) == 4 and predicted_blocks(20, 340, 16, 32) == 20


def test_counts_and_the_alarm_sound_once_per_full_window_per_kind():
    audit = MissAudit(window=4, rate=0.5)
    outcomes = [audit.observe("w", p, c) for p, c in [(3, 3), (3, 0), (2, 0), (0, 0)]]
    assert outcomes[:3] == [None, None, None]  # the window is not full yet
    alarm = outcomes[3]
    assert alarm is not None and (alarm.kind, alarm.count, alarm.window) == ("silent_miss", 2, 4)
    assert "silent misses" in alarm.message() and "worker w" in alarm.message()
    # Still at the rate: quiet until a whole window has passed.
    assert [audit.observe("w", 1, 0) for _ in range(3)] == [None] * 3
    assert audit.observe("w", 1, 0) is not None
    assert audit.take() == {"w": WorkerAudit(requests=8, predicted_blocks=12, cached_blocks=3, predicted_hits=7,
                                             cached_hits=1, silent_misses=6, unseen_hits=0)}
    assert audit.take() == {}
    # Unseen hits: the engine used more than the index said.
    other = MissAudit(window=2, rate=1.0)
    assert other.observe("v", 0, 2) is None
    assert other.observe("v", 1, 3).kind == "unseen_hit"


def test_rate_zero_never_alarms_and_workers_that_left_are_forgotten():
    audit = MissAudit(window=1, rate=0.0)
    assert audit.observe("w", 5, 0) is None
    audit.forget({"x"})
    assert audit._recent == {}
