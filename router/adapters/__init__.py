"""The router's adapters: its gRPC and OpenAI HTTP APIs, and its clients of the kv_service and the workers (gRPC, OpenAI HTTP)."""
