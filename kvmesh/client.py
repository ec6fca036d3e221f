"""A small Python client for the kvmesh router.

    from kvmesh.client import Client

    with Client("127.0.0.1:50051") as client:
        for delta in client.stream("Once upon a time", max_tokens=32):
            print(delta.text, end="", flush=True)
        result = client.generate("Once upon a time", max_tokens=32)
        print(result.text, result.usage.cached_tokens, result.served_by)
        chat = client.generate([{"role": "user", "content": "Hi"}], model="my-model", stop=["\n"])

Errors arrive as ``grpc.RpcError`` with the server's status code and message.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kvmesh.contract.convert import PB_TO_FINISH, usage_from_pb
from kvmesh.contract.types import Usage
from kvmesh.transport.channels import dial
from kvmesh.v1 import common_pb2
from kvmesh.v1 import router_pb2 as pb
from kvmesh.v1 import router_pb2_grpc as pb_grpc


@dataclass(slots=True)
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    served_by: str = ""
    usage: Usage = field(default_factory=Usage)
    request_id: str = ""
    """The id the request has in the router's and the worker's logs (quote it when reporting a problem)."""

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "served_by": self.served_by, "request_id": self.request_id,
                "usage": {"prompt_tokens": self.usage.prompt_tokens, "cached_tokens": self.usage.cached_tokens,
                          "completion_tokens": self.usage.completion_tokens}}


Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]
"""Text, token ids, or chat messages (``{"role", "content"}``, rendered by the model's chat template)."""


def make_request(prompt: Prompt, *, max_tokens: int | None = None, temperature: float = 0.0,
                 top_p: float | None = None, top_k: int = 0, seed: int | None = None,
                 stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, cache_salt: str = "",
                 request_id: str = "", model: str = "", stop: Sequence[str] = ()) -> pb.GenerateRequest:
    """A GenerateRequest; ``None`` leaves a field unset (the server's default)."""
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                         seed=seed, stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
    req = pb.GenerateRequest(sampling=sampling, cache_salt=cache_salt, request_id=request_id, model=model,
                             stop=list(stop))
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], Mapping):
        req.chat.messages.extend(pb.ChatMessage(**m) for m in prompt)  # type: ignore[arg-type]
    else:
        req.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    return req


class Client:
    """Args:
    target: the router's host:port.
    timeout: deadline of one request in seconds.
    """

    def __init__(self, target: str = "127.0.0.1:50051", timeout: float = 600.0) -> None:
        self._channel = dial(target)
        self._stub = pb_grpc.RouterStub(self._channel)
        self.timeout = timeout

    def stream(self, prompt: Prompt, **kwargs) -> Iterator[pb.GenerateResponse]:
        """Yields the router's messages as they arrive (keyword args as in ``make_request``)."""
        yield from self._stub.Generate(make_request(prompt, **kwargs), timeout=self.timeout)

    def generate(self, prompt: Prompt, **kwargs) -> Completion:
        """Runs one request to the end and returns the whole completion."""
        out = Completion()
        for msg in self.stream(prompt, **kwargs):
            if msg.request_id:
                out.request_id = msg.request_id
            out.text += msg.text
            out.token_ids.extend(msg.token_ids)
            if msg.finish_reason:
                out.finish_reason = PB_TO_FINISH.get(msg.finish_reason)
                out.served_by = msg.served_by
                out.usage = usage_from_pb(msg.usage)
        return out

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
