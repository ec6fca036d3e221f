"""Prometheus /metrics pages of the processes under test, parsed with prometheus_client's parser."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator, Sequence

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def scrape(port: int, timeout: float = 5.0) -> str:
    """A /metrics page on localhost."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        return r.read().decode()


def samples(text: str, name: str) -> Iterator[Sample]:
    """Every sample of the metric family ``name`` (a counter's ``_total`` suffix may be left on)."""
    family = name.removesuffix("_total")
    for metric in text_string_to_metric_families(text):
        if metric.name == family:
            yield from metric.samples


def gauge(text: str, name: str) -> float:
    """One unlabelled gauge (0.0 when absent)."""
    return next((s.value for s in samples(text, name) if s.name == name and not s.labels), 0.0)


def label_counts(text: str, name: str, label: str) -> dict[str, int]:
    """A labelled counter as {label value: count}, summed over its other labels (empty when absent)."""
    out: dict[str, int] = {}
    for s in samples(text, name):
        if s.name.endswith("_total") and label in s.labels:
            out[s.labels[label]] = out.get(s.labels[label], 0) + int(s.value)
    return out


def histogram_quantile(texts: Sequence[str], name: str, q: float) -> float:
    """The upper bound of the bucket holding quantile ``q`` over the histograms in ``texts``
    (inf when it lies past the last finite bucket, 0.0 when nothing was observed)."""
    buckets: dict[float, float] = {}
    for text in texts:
        for s in samples(text, name):
            if s.name == f"{name}_bucket":
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
    total = buckets.get(float("inf"), 0.0)
    if not total:
        return 0.0
    return next((le for le in sorted(buckets) if buckets[le] >= q * total), float("inf"))
