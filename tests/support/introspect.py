"""What standard gRPC tools (grpcurl, grpc_health_probe) get from a daemon: health ``List``
and server reflection ``v1`` and ``v1alpha``."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

SERVICES = {"episerve.v1.EpiServe", "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}


def assert_standard_tools_answer(target: str) -> None:
    """Health lists the daemon as SERVING; both reflection versions list every service and
    describe the episerve service and reflection v1 itself."""
    with grpc.insecure_channel(target) as channel:
        listed = channel.unary_unary(
            "/grpc.health.v1.Health/List",
            request_serializer=health_pb2.HealthListRequest.SerializeToString,
            response_deserializer=health_pb2.HealthListResponse.FromString)(
            health_pb2.HealthListRequest(), timeout=10)
        assert {k: v.status for k, v in listed.statuses.items()} == {
            "": health_pb2.HealthCheckResponse.SERVING,
            "episerve.v1.EpiServe": health_pb2.HealthCheckResponse.SERVING}
        for version in ("v1", "v1alpha"):
            info = channel.stream_stream(
                f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
            out = list(info(iter([
                reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="episerve.v1.EpiServe"),
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="grpc.reflection.v1.ServerReflection"),
            ]), timeout=10))
            names = {s.name for s in out[0].list_services_response.service}
            assert names >= SERVICES, version
            for answer in out[1:]:
                assert answer.WhichOneof("message_response") == "file_descriptor_response"
