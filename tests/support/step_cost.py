"""A worker's cumulative load reports whose busy seconds follow a known linear step cost (the router's
step-cost learner's tests: router/core/policies/cost.py)."""

from __future__ import annotations

import random
from collections.abc import Mapping

from kvmesh.contract.types import Load

COEFFICIENTS = ("step_s", "prefill_token_s", "prefill_pair_s", "decode_seq_s", "decode_context_token_s")
COUNTERS = ("steps", "prefill_tokens", "prefill_pairs", "decode_tokens", "decode_context_tokens")


def linear_reports(cost: Mapping[str, float], reports: int, seed: int) -> list[Load]:
    """``reports`` cumulative loads of varied steps (random work per report), busy seconds exactly
    ``cost`` (its keys: COEFFICIENTS) applied to the work."""
    rng = random.Random(seed)
    c = dict(busy_s=0.0, **dict.fromkeys(COUNTERS, 0))
    out = []
    for _ in range(reports):
        d = dict(steps=rng.randint(50, 500), prefill_tokens=rng.randint(0, 50_000), prefill_pairs=rng.randint(0, 10**9),
                 decode_tokens=rng.randint(0, 20_000), decode_context_tokens=rng.randint(0, 10**8))
        for k, v in d.items():
            c[k] += v
        c["busy_s"] += sum(cost[k] * d[n] for k, n in zip(COEFFICIENTS, COUNTERS, strict=True))
        out.append(Load(**c))
    return out
