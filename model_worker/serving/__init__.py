"""The server side: the gRPC adapter of the engine and its Prometheus metrics."""
