"""Server reflection v1 (what grpcurl asks first) beside grpcio-reflection's v1alpha."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import _async as reflection_aio
from grpc_reflection.v1alpha import reflection_pb2 as reflection_v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as reflection_v1alpha_pb2_grpc

REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
"""grpcurl and current tools ask reflection v1 first; grpcio-reflection ships only v1alpha."""


def _reflection_v1_descriptor() -> None:
    """Adds ``grpc/reflection/v1/reflection.proto`` to the default pool (so reflection can describe
    itself), derived from v1alpha's: v1 is the same messages with the same field numbers under
    another package, so the bytes on the wire are identical."""
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(REFLECTION_V1)
        return
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto.FromString(reflection_v1alpha_pb2.DESCRIPTOR.serialized_pb)
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    fdp.name, fdp.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    fdp.ClearField("options")
    for message in fdp.message_type:
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(old, new)
    for service in fdp.service:
        for m in service.method:
            m.input_type, m.output_type = m.input_type.replace(old, new), m.output_type.replace(old, new)
    pool.Add(fdp)


def enable_reflection(server: grpc.aio.Server, service_names: list[str]) -> None:
    """Serves reflection v1 and v1alpha (one servicer; v1 uses v1alpha's wire-identical messages)."""
    _reflection_v1_descriptor()
    servicer = reflection_aio.ReflectionServicer([*service_names, REFLECTION_V1])
    reflection_v1alpha_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(REFLECTION_V1, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_v1alpha_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_v1alpha_pb2.ServerReflectionResponse.SerializeToString),
    })])
