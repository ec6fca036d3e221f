"""A hot prefix in the simulator: kv-aware spreads it over the workers its load needs, and three
routers make the same spread as one (issue 42; router/core/policies/prefix_load.py).

Deterministic: a fixed seed in virtual time. The workload: private prompts at 20 requests/s throughout,
and a prefix of 4,096 tokens (each request with 512 tokens of its own) at 2, then 40, then 2 requests/s
for 10 s each: at its peak it is two thirds of the requests to 8 workers. A hit on it computes only
its 512 tokens, so the workers it needs are fewer than its share of requests says: at its peak kv-aware
keeps it on three workers (and two more take a few requests), each with about a third.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from kvmesh.sim.config import SimConfig
from kvmesh.sim.mesh import Mesh
from kvmesh.sim.run import chains_for, sim_model_dir
from kvmesh.sim.workload import SimRequest, Workload

HOT = 7
"""The hot prefix's segment id."""
PHASES = ((0.0, 10.0, 2.0), (10.0, 20.0, 40.0), (20.0, 30.0, 2.0))
"""(start s, end s, the prefix's requests/s)."""


def ramp(seed: int = 0, background_rate: float = 20.0) -> Workload:
    rng = np.random.default_rng(seed)
    events: list[tuple[float, bool]] = []
    for start, end, rate in PHASES:
        times = rng.uniform(start, end, rng.poisson(rate * (end - start)))
        events += [(float(t), True) for t in times]
    end = PHASES[-1][1]
    events += [(float(t), False) for t in rng.uniform(0.0, end, rng.poisson(background_rate * end))]
    reqs = []
    for t, hot in sorted(events):
        i = len(reqs)
        segs = ((HOT, 4096), (-(i + 1), 512)) if hot else ((-(i + 1), 2048),)
        reqs.append(SimRequest(i, t, sum(n for _, n in segs), 128, segs))
    return Workload("ramp", reqs)


def spread(routers: int) -> list[Counter]:
    """Per phase, the prefix's requests per worker."""
    w = ramp()
    cfg = SimConfig(workers=8, routers=routers, seed=1)
    records = Mesh(cfg, w, sim_model_dir(), chains_for(w, cfg.block_size)).run()
    assert all(r.finish is not None and not r.failed for r in records)
    out = []
    for start, end, _ in PHASES:
        out.append(Counter(r.worker for r in records
                           if start <= r.arrival < end and w.requests[r.index].segments[0][0] == HOT))
    return out


def busiest_share(c: Counter) -> float:
    return max(c.values()) / sum(c.values())


def test_a_hot_prefix_takes_the_workers_its_load_needs_and_three_routers_spread_it_like_one():
    one, three = spread(1), spread(3)
    low, peak, _ = one
    # at its peak it spreads to a second and a third worker: none carries a third of it (131, 129, 118,
    # 19, 10 requests; three routers 108, 106, 98, 95); until issue 42 the busiest carried 36 % (three
    # routers: 42 %)
    assert busiest_share(peak) <= 1 / 3 and len(peak) >= 3, peak
    assert len(low) <= 2, low  # at 2 requests/s, one or two workers
    for a, b in zip(one, three, strict=True):
        # three routers make the same spread: as many workers (within one), as even
        assert abs(len(a) - len(b)) <= 1, (one, three)
        assert abs(busiest_share(a) - busiest_share(b)) <= 0.1, (one, three)
