"""External tensor data anywhere in an ONNX model: inlined from allowed files, or refused.

ONNX lets any tensor keep its bytes in a file named by ``external_data`` (``location``,
``offset``, ``length``): graph initializers, but also Constant node attributes, sparse
initializers and the initializers and attributes of If / Loop / Scan bodies and functions. The
checker does not look at the files, and a runtime given the model later resolves them against
its working directory, so a job's model naming ``job.json`` would read the worker's files.

``inline_external_data`` walks every tensor of the model and replaces each external reference
by the bytes it names, so what is built and cached is self-contained. A location must be a
relative path without ``..`` that resolves (symlinks followed) to a regular file inside the
model's folder; in the worker, ``confine_to`` narrows that to the job's own artifacts. Anything
else, a range outside the file, or a length that does not match the tensor is ``bad_model``.
Worker side: Python 3.6.
"""

import os
from typing import Any, Iterable, Iterator, List, Optional, Tuple

import numpy as np
from onnx import ModelProto, TensorProto, helper

from agent.errors import AgentError

MAX_INLINE_BYTES = (2 << 30) - 1  # protobuf's limit on one serialized model
_allowed: Optional[List[str]] = None


def confine_to(paths: Iterable[str]) -> None:
    """Only these files may hold external tensor data (the worker: the job's artifacts)."""
    global _allowed
    _allowed = [os.path.realpath(p) for p in paths]


def _itemsize(elem_type: int) -> Optional[int]:
    try:
        if hasattr(helper, "tensor_dtype_to_np_dtype"):
            return int(np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize)
        from onnx import mapping  # type: ignore  # onnx < 1.13

        return int(np.dtype(mapping.TENSOR_TYPE_TO_NP_TYPE[elem_type]).itemsize)
    except (KeyError, TypeError, ValueError):
        return None


def iter_tensors(model: ModelProto) -> Iterator[Tuple[TensorProto, str]]:
    """Every tensor in the model with where it sits, subgraphs and functions included
    (a stack, not recursion: bodies may nest)."""
    stack: List[Tuple[Any, str]] = [(model.graph, "graph")]
    for fn in getattr(model, "functions", []):
        stack.append((fn, "function {}".format(fn.name)))
    for i, info in enumerate(getattr(model, "training_info", [])):
        stack.append((info.initialization, "training_info {} initialization".format(i)))
        stack.append((info.algorithm, "training_info {} algorithm".format(i)))
    while stack:
        graph, where = stack.pop()
        for t in getattr(graph, "initializer", []):
            yield t, "{} initializer {!r}".format(where, t.name)
        for s in getattr(graph, "sparse_initializer", []):
            yield s.values, "{} sparse initializer {!r} values".format(where, s.values.name)
            yield s.indices, "{} sparse initializer {!r} indices".format(where, s.values.name)
        for node in graph.node:
            at = "{} node {!r} ({})".format(where, node.name, node.op_type)
            for attr in node.attribute:
                here = "{} attribute {!r}".format(at, attr.name)
                if attr.HasField("t"):
                    yield attr.t, here
                for t in attr.tensors:
                    yield t, here
                sparse = [attr.sparse_tensor] if attr.HasField("sparse_tensor") else []
                for s in sparse + list(attr.sparse_tensors):
                    yield s.values, here + " values"
                    yield s.indices, here + " indices"
                if attr.HasField("g"):
                    stack.append((attr.g, here))
                for g in attr.graphs:
                    stack.append((g, here))


def _entries(tensor: TensorProto, where: str) -> Tuple[str, int, Optional[int]]:
    info = {e.key: e.value for e in tensor.external_data}
    location = info.get("location", "")
    try:
        offset = int(info.get("offset") or 0)
        length = int(info["length"]) if info.get("length") else None
    except ValueError:
        raise AgentError("bad_model", "{}: external data offset/length must be integers, found "
                         "{!r} / {!r}".format(where, info.get("offset"), info.get("length")))
    if offset < 0 or (length is not None and length < 0):
        raise AgentError("bad_model", "{}: external data offset/length must be >= 0".format(
            where))
    return location, offset, length


def _resolve(location: str, base_dir: str, where: str) -> str:
    parts = location.replace("\\", "/").split("/")
    if not location or os.path.isabs(location) or location.startswith(("/", "\\")) \
            or ".." in parts or "\0" in location:
        raise AgentError("bad_model", "{}: external data location {!r}: expected a file name "
                         "relative to the model (no absolute path, no '..')".format(
                             where, location[:200]))
    base = os.path.realpath(base_dir)
    path = os.path.realpath(os.path.join(base, location))
    if os.path.commonpath([base, path]) != base:
        raise AgentError("bad_model", "{}: external data location {!r} leads outside the "
                         "model's folder (a symlink?)".format(where, location))
    if _allowed is not None and path not in _allowed:
        raise AgentError("bad_model", "{}: external data location {!r} is not an artifact of "
                         "this job; a job's model must hold its weights (or name one of the "
                         "job's own artifacts)".format(where, location))
    if not os.path.isfile(path):
        raise AgentError("file_not_found", "{}: external data location {!r}: expected a file "
                         "beside the model, found none".format(where, location))
    return path


def inline_external_data(model: ModelProto, model_path: str,
                         base_dir: Optional[str] = None) -> ModelProto:
    """Replace every external tensor reference in ``model`` (read from ``model_path``) by the
    bytes it names in ``base_dir``, in place; ``bad_model`` when a reference is not allowed or
    wrong, or for any reference when there is no ``base_dir`` (bytes, an engine)."""
    total = 0
    for tensor, where in iter_tensors(model):
        if tensor.data_location != TensorProto.EXTERNAL and not len(tensor.external_data):
            continue
        where = "{}: {}".format(model_path, where)
        if base_dir is None:
            raise AgentError("bad_model", "{}: the tensor's bytes live in another file ({}); "
                             "expected a self-contained model".format(
                                 where, ", ".join("{}={}".format(e.key, e.value[:100])
                                                  for e in tensor.external_data)))
        location, offset, length = _entries(tensor, where)
        path = _resolve(location, base_dir, where)
        size = os.path.getsize(path)
        itemsize = _itemsize(tensor.data_type)
        if itemsize is None or tensor.data_type == TensorProto.STRING:
            raise AgentError("bad_model", "{}: external data for a tensor of type {} is not "
                             "supported".format(where, tensor.data_type))
        count = 1
        for d in tensor.dims:
            count *= int(d)
        expected = count * itemsize
        if length is None:
            length = size - offset
        if length != expected or offset + length > size or count < 0:
            raise AgentError("bad_model", "{}: external data in {!r} at offset {} length {}: "
                             "expected {:,} bytes for dims {} within the file's {:,}".format(
                                 where, location, offset, length, expected,
                                 list(tensor.dims), size))
        total += length
        if total > MAX_INLINE_BYTES:
            raise AgentError("bad_model", "{}: external data adds up to more than {:,} bytes, "
                             "the most one ONNX model can hold".format(where, MAX_INLINE_BYTES))
        with open(path, "rb") as f:
            f.seek(offset)
            tensor.raw_data = f.read(length)
        del tensor.external_data[:]
        tensor.data_location = TensorProto.DEFAULT
    return model


def is_self_contained(model: ModelProto) -> bool:
    return not any(t.data_location == TensorProto.EXTERNAL or len(t.external_data)
                   for t, _ in iter_tensors(model))
