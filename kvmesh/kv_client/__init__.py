"""The kv_service's clients: the worker's publisher (registration, events, heartbeats, resync) and its event batcher, the router's Lookup/Reserve client and the admin client."""
