"""Prefill/decode disaggregation's transports between workers (NIXL); no grpc."""
