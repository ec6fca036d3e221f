"""Generated gRPC stubs of protos/kvmesh/v1 (run `make protos`)."""
