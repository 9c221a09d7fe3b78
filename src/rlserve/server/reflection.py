"""gRPC server reflection under both of its names: `grpc.reflection.v1`, which current grpcurl
and grpcui ask first, and `grpc.reflection.v1alpha` for older clients. grpcio-reflection ships
v1alpha only; v1 is the same protocol in a renamed package (same messages, same field
numbers), so one servicer answers both, and v1's own descriptor, v1alpha's renamed, joins the
descriptor pool so that a client can describe the v1 service too."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA = reflection.SERVICE_NAME
V1 = "grpc.reflection.v1.ServerReflection"
SERVICE_NAMES = (V1, V1ALPHA)
_V1ALPHA_PACKAGE, _V1_PACKAGE = "grpc.reflection.v1alpha", "grpc.reflection.v1"


def enable(service_names: list[str], server: grpc.aio.Server) -> None:
    """Serves reflection on `server` for `service_names` and both reflection services."""
    _add_v1_descriptor(descriptor_pool.Default())
    servicer = reflection.aio.ReflectionServicer([*service_names, *SERVICE_NAMES])
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler}) for name in SERVICE_NAMES]
    )


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """Idempotent; a pool that knows v1 already (a later grpcio-reflection) is left alone."""
    try:
        pool.FindServiceByName(V1)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name = "grpc/reflection/v1/reflection.proto"
    proto.package = _V1_PACKAGE
    proto.ClearField("options")  # v1alpha's are deprecated=true and its Java/Go packages
    old, new = f".{_V1ALPHA_PACKAGE}.", f".{_V1_PACKAGE}."
    for message in proto.message_type:
        for field in message.field:
            if field.type_name:  # a message field; setting one on a scalar is an error
                field.type_name = field.type_name.replace(old, new, 1)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new, 1)
            method.output_type = method.output_type.replace(old, new, 1)
    pool.Add(proto)
