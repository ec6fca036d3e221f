"""Ports handed out by kvmesh.loopback are never handed out twice in one process: a port is free
only until its server binds it, so two calls in a row must not both return it."""

from kvmesh import loopback


def test_free_ports_are_never_handed_out_twice(monkeypatch):
    monkeypatch.setattr(loopback, "_HANDED_OUT", set())
    lo, hi = 20000, 20100  # a narrow range: 30 draws repeat with p ~ 0.99 without the rule
    singles = [loopback.free_port(lo, hi) for _ in range(30)]
    assert len(set(singles)) == 30
    # NOTE: the run from a wider range: 30 of the narrow range's 100 ports are taken by now.
    run = loopback.free_port_run(4, lo, lo + 1000)
    assert not set(range(run, run + 4)) & set(singles)
