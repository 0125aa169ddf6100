"""Triton's model control over gRPC (``inference.GRPCInferenceService/RepositoryModelLoad`` and
``RepositoryModelUnload``), for the ``triton`` hand-off's ``grpc_url``.

Why not HTTP: Triton's HTTP endpoint runs a load request to the end on the HTTP worker thread
that received it, and its libevhtp pool puts every connection of an idle server on the same
first worker thread; a response that is due on that thread while a model loads (the app's
request in flight at that moment) waits for the whole load (seconds). The gRPC endpoint has its
own threads, so a switch holds no request longer than the load's CPU use slows it.

The two request messages are written by hand (grpc_service.proto: ``repository_name = 1``,
``model_name = 2``, ``map<string, ModelRepositoryParameter> parameters = 3``;
``ModelRepositoryParameter.string_param = 3``): no generated code, no protobuf package. The
answers carry nothing we need; a failure is a gRPC status with Triton's message.
"""

from typing import Optional

import grpc  # type: ignore  # no stubs; optional (the triton extra)

SERVICE = "/inference.GRPCInferenceService/"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): strings, bytes, messages, map entries."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def request(name: str, config: Optional[str] = None) -> bytes:
    """RepositoryModelLoadRequest / RepositoryModelUnloadRequest for ``name`` (with the load
    API's ``config`` parameter when given)."""
    body = _field(2, name.encode("utf-8"))
    if config is not None:
        entry = _field(1, b"config") + _field(2, _field(3, config.encode("utf-8")))
        body += _field(3, entry)
    return body


def call(target: str, method: str, name: str, config: Optional[str], timeout: float
         ) -> Optional[str]:
    """One unary call; None when Triton answered OK, else its status and message."""
    channel = grpc.insecure_channel(target)
    try:
        stub = channel.unary_unary(SERVICE + method)
        stub(request(name, config), timeout=timeout)
        return None
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return "gRPC {}: {}".format(getattr(code, "name", code), (details or "")[:500])
    finally:
        channel.close()
