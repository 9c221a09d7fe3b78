from rlserve.api.vllm import control_pb2 as _control_pb2
from rlserve.api.vllm import inference_pb2 as _inference_pb2
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor
