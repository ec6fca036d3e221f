"""The router's front doors: the gRPC and OpenAI HTTP APIs, the request-body parser and the Frontend both call."""
