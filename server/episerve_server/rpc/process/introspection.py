"""Health and reflection services, as standard gRPC tools expect them.

- ``grpc.health.v1.Health``: ``Check`` and ``Watch`` from grpcio-health-checking, plus
  ``List`` (grpcio-health-checking 1.85 leaves it unimplemented, which answers with an
  ERROR traceback in the log).
- Server reflection ``v1`` and ``v1alpha``: grpcio-reflection 1.85 ships only ``v1alpha``.
  The two protocols are the same messages under another package name (identical field
  numbers), so ``v1`` is served by the same servicer under its own method path, and a
  ``v1`` descriptor, renamed from the ``v1alpha`` one, is added to the descriptor pool so
  that the ``v1`` service can itself be described.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
REFLECTION_V1ALPHA = reflection.SERVICE_NAME
_V1_FILE = "grpc/reflection/v1/reflection.proto"


class HealthServicer(health.aio.HealthServicer):  # type: ignore[misc]
    """The standard servicer, with ``List``: every service's status at once."""

    async def List(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status)
            for name, status in self._server_status.items()})


def add_health(server: grpc.aio.Server) -> HealthServicer:
    servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


def add_reflection(server: grpc.aio.Server, services: Sequence[str]) -> None:
    """Reflection v1 and v1alpha over ``services`` (health and reflection are added)."""
    _register_v1_descriptor()
    names = (*services, health.SERVICE_NAME, REFLECTION_V1, REFLECTION_V1ALPHA)
    servicer = reflection.aio.ReflectionServicer(names)
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler(REFLECTION_V1ALPHA,
                                             {"ServerReflectionInfo": method}),
        grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": method}),
    ))


def _register_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
        return  # already there (a later grpcio-reflection, or a second daemon in-process)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    proto.options.Clear()
    for message in proto.message_type:
        for f in message.field:
            if f.HasField("type_name"):
                f.type_name = f.type_name.replace(old, new)
    for service in proto.service:
        for m in service.method:
            m.input_type = m.input_type.replace(old, new)
            m.output_type = m.output_type.replace(old, new)
    pool.Add(proto)
