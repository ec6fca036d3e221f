"""gRPC plumbing shared by every server and client: channels, servers, health, errors, security."""
