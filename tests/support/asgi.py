"""One HTTP request played straight into an ASGI app (no server, no socket): for the HTTP front's tests."""

from __future__ import annotations

from typing import Any


async def asgi_call(app: Any, method: str, path: str, headers: dict[str, str], chunks: list[bytes]
                    ) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """Sends the request's body in ``chunks``; returns the response start, every message sent and the scope."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0], sent, scope
