"""Ports handed out by kvmesh.loopback are never handed out twice in one process: a port is free
only until its server binds it, so two calls in a row must not both return it."""

from kvmesh import loopback


def test_free_ports_are_never_handed_out_twice(monkeypatch):
    monkeypatch.setattr(loopback, "_HANDED_OUT", set())
    lo, hi = 20000, 20040  # a narrow range, so a repeat would be likely without the rule
    singles = [loopback.free_port(lo, hi) for _ in range(20)]
    assert len(set(singles)) == 20
    run = loopback.free_port_run(4, lo, hi)
    assert not set(range(run, run + 4)) & set(singles)
