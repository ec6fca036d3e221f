"""The router's gRPC adapter: a GenerateRequest becomes the request path's GenerateInput (every
repeated field counted against its bound first), its GenerateOutputs become GenerateResponses."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format

from kvmesh.contract.convert import FINISH_TO_PB, sampling_from_pb, usage_to_pb
from kvmesh.contract.errors import InvalidArgument
from kvmesh.contract.limits import MAX_STOP_TOKEN_IDS
from kvmesh.router.api.frontend import Frontend
from kvmesh.router.api.objectives import objectives_of
from kvmesh.router.config import RouterConfig
from kvmesh.router.generate_types import ChatInput, GenerateInput
from kvmesh.router.text.prompt import check_message_count
from kvmesh.router.text.stop_strings import MAX_STOP_STRINGS
from kvmesh.transport import tracing
from kvmesh.transport.status import code_of
from kvmesh.v1 import router_pb2 as pb
from kvmesh.v1 import router_pb2_grpc as pb_grpc

log = logging.getLogger("kvmesh.router")

T = TypeVar("T")

MAX_TEMPLATE_KWARGS_BYTES = 64 * 1024
"""Serialized size of a chat request's chat_template_kwargs (the HTTP API bounds its JSON values)."""

GENERATE_RPC = tracing.rpc_attributes(pb.DESCRIPTOR.services_by_name["Router"].full_name, "Generate")
"""The attributes of a Generate call's ``router.request`` span (OpenTelemetry's RPC conventions)."""

REQUEST_ID_KEY = "kvmesh-request-id"
"""Trailing metadata of every Generate call that got an id (success or error): the id the request
has in the router's and the worker's logs."""


def input_from_pb(request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                  config: RouterConfig) -> GenerateInput:
    """The request as the request path takes it. Every repeated field is counted against its bound
    before anything is made of its elements (a million messages cost a length check, not a million dicts)."""
    which = request.WhichOneof("input")
    remaining = context.time_remaining()
    if len(request.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"stop has {len(request.stop)} strings; at most {MAX_STOP_STRINGS}", param="stop")
    if len(request.sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(f"stop_token_ids has {len(request.sampling.stop_token_ids)} ids; at most "
                              f"{MAX_STOP_TOKEN_IDS}", param="stop_token_ids")
    chat = None
    if which == "chat":
        c = request.chat
        check_message_count(len(c.messages), config.max_messages)
        if c.HasField("chat_template_kwargs") and c.chat_template_kwargs.ByteSize() > MAX_TEMPLATE_KWARGS_BYTES:
            raise InvalidArgument(f"chat_template_kwargs is over {MAX_TEMPLATE_KWARGS_BYTES} bytes",
                                  param="chat_template_kwargs")
        chat = ChatInput(
            messages=[{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
                      for m in c.messages],
            add_generation_prompt=c.add_generation_prompt if c.HasField("add_generation_prompt") else True,
            continue_final_message=c.continue_final_message,
            template_kwargs=json_format.MessageToDict(c.chat_template_kwargs) if c.HasField("chat_template_kwargs")
            else {},
        )
    return GenerateInput(
        text=request.text if which == "text" else None,
        token_ids=request.token_ids.ids if which == "token_ids" else None,
        sampling=sampling_from_pb(request.sampling),  # ValueError -> INVALID_ARGUMENT with its message
        cache_salt=request.cache_salt,
        request_id=request.request_id,
        timeout_s=None if remaining is None else max(0.0, remaining),
        chat=chat,
        stop=list(request.stop),
        include_stop_str_in_output=request.include_stop_str_in_output,
        objectives=objectives_of(request.slo_ttft_ms if request.HasField("slo_ttft_ms") else None,
                                 request.slo_tpot_ms if request.HasField("slo_tpot_ms") else None,
                                 config.default_objectives(), ("slo_ttft_ms", "slo_tpot_ms")),
    )


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, frontend: Frontend, config: RouterConfig) -> None:
        self.frontend = frontend
        self.config = config

    def Generate(self, request: pb.GenerateRequest,
                 context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        """The call's stream (the error interceptor iterates it): traced while tracing is on."""
        if not tracing.ON:
            return self._generate(request, context, None)
        return self._traced(request, context)

    async def _traced(self, request: pb.GenerateRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        # NOTE: the request's span opens before anything is checked: a refused request has its trace too.
        span = tracing.start("router.request", tracing.extract(context.invocation_metadata()), GENERATE_RPC,
                             kind="server")
        try:
            async for msg in self._generate(request, context, span):
                yield msg
        except BaseException as exc:
            tracing.end_rpc(span, code_of(exc), exc)
            raise
        tracing.set_ok(span)
        tracing.end_rpc(span, tracing.GRPC_OK)

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                        span: Any) -> AsyncIterator[pb.GenerateResponse]:
        model, adapter = self.frontend.target(request.model)
        inp = input_from_pb(request, context, self.config)
        if adapter:
            inp = replace(inp, adapter=adapter)
        rid = model.router.request_id_for(inp)
        context.set_trailing_metadata(((REQUEST_ID_KEY, rid),))
        async for out in self.frontend.generate(model, inp, rid, span):
            msg = pb.GenerateResponse(token_ids=out.token_ids, text=out.text, request_id=out.request_id)
            if out.finish_reason is not None:
                msg.finish_reason = FINISH_TO_PB[out.finish_reason]
                msg.served_by = out.served_by
                if out.usage is not None:
                    msg.usage.CopyFrom(usage_to_pb(out.usage))
            yield msg

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        models = self.frontend.models
        default = models.default()
        adapters = [pb.ModelInfo(id=name, workers=sum(e.load.adapter(name) is not None for e in m.pool.endpoints()),
                                 tokenizer=m.files is not None,
                                 chat_template=m.files is not None and m.files.chat_template is not None,
                                 parent=m.model_id)
                    for name, m in sorted(models.adapters().items())]
        return pb.ListModelsResponse(
            models=[pb.ModelInfo(id=m.model_id, workers=len(m.pool.endpoints()), tokenizer=m.files is not None,
                                 chat_template=m.files is not None and m.files.chat_template is not None)
                    for m in models.all()] + adapters,
            default_model=default.model_id if default is not None else "")
