"""The bench's /metrics readers on a page prometheus_client itself wrote."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvmesh.bench.scrape import gauge, histogram_quantile, label_counts


def page() -> str:
    reg = CollectorRegistry()
    Gauge("busy_seconds", "busy", registry=reg).set(2.5)
    c = Counter("decisions_total", "decisions", ["policy", "reason"], registry=reg)
    c.labels("kv-aware", "prefix").inc(3)
    c.labels("dynamo", "prefix").inc(2)
    c.labels("kv-aware", "load").inc()
    h = Histogram("lookup_seconds", "lookups", buckets=(0.001, 0.01, 0.1), registry=reg)
    for v in (0.0005, 0.0005, 0.005, 0.05):
        h.observe(v)
    return generate_latest(reg).decode()


def test_gauge_counter_and_quantile():
    text = page()
    assert gauge(text, "busy_seconds") == 2.5
    assert gauge(text, "absent") == 0.0
    assert label_counts(text, "decisions_total", "reason") == {"prefix": 5, "load": 1}
    assert label_counts(text, "decisions_total", "policy") == {"kv-aware": 4, "dynamo": 2}
    assert histogram_quantile([text], "lookup_seconds", 0.5) == 0.001
    assert histogram_quantile([text], "lookup_seconds", 0.75) == 0.01
    assert histogram_quantile([text, text], "lookup_seconds", 0.99) == 0.1
    assert histogram_quantile([], "lookup_seconds", 0.99) == 0.0
