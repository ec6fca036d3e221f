"""Scheduling: requests, the scheduler and the KV-cache chain (block pool, single-type managers, coordinator, manager) that decides which blocks each request gets."""
