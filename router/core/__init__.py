"""The router's pure core: decisions (RoutingCore), in-flight view, speculative map, attempts, worker set and the types of what it needs from outside. No grpc, no redis, no I/O."""
