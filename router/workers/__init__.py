"""The router's worker side: the worker pools, the calls to workers (gRPC and OpenAI HTTP) and discovery."""
