"""Triton hand-off: a Triton model repository kept in step with models_dir, and (with ``url``)
Triton's explicit model control API.

Owns ``<repository>/<name>/``: ``config.pbtxt`` (``platform: "tensorrt_plan"``, inputs and
outputs with Triton data types and dims from meta.json, ``version_policy: { specific { versions
[...] } }`` listing the versions Triton is to hold in memory: ``loaded_versions`` of them, the
new one first), integer version folders
``<N>/model.plan`` (a hard link to the engine, a copy across filesystems) with ``<N>/meta.json``
(the version's meta plus ``"triton": {"model", "version"}``), and ``jetson-agent-versions.json``
mapping every N to our version; ``keep_versions`` folders stay on disk (unlisted ones are
rollback targets Triton ignores until a revert lists them). Each activation gets a fresh N, so
the version being switched to is always Triton's highest (the one served when a request names
no version), also when rolling back to an older one.

Steps: ``prepare`` writes the version folder (unlisted in config.pbtxt, so Triton ignores it);
``switch``, with ``url``, POSTs ``/v2/repository/models/<name>/load`` with the new config as the
load API's ``config`` parameter (the loaded versions keep serving until the new one is ready;
no repository rescan), then writes the same config to config.pbtxt for Triton's next start
(without ``url`` Triton's ``poll`` mode picks the file up); ``confirm`` polls
``/v2/models/<name>/versions/<N>/ready`` and then sends that version one inference request of
zeros shaped from meta.json: a version that loads but cannot serve is refused with Triton's own
error text (None without ``url``); ``revert`` lists only the previous version and loads again
(unloads when there is none). In explicit mode a failed load leaves the loaded versions serving.
``heal`` (the daemon's tick, every few seconds) asks whether each committed version is ready
and loads again what a restarted Triton no longer has: explicit mode loads nothing at start.

An engine built for a DLA core gets ``instance_group [{ kind: KIND_GPU, secondary_devices [{
kind: KIND_NVDLA, device_id: N }] }]``; ``max_batch_size`` above the engine profile's maximum
batch is refused (``batch_size_exceeds_profile``) before anything is written.

Files are 0640 and folders 0750 (the models group reads them, as in models_dir).

Config keys (``from_config``): ``repository`` (required), ``url`` (http://host:port),
``max_batch_size`` (0: dims are the full shapes), ``instance_group`` ({kind: gpu|cpu|auto,
count}), ``timeout_s`` (60), ``keep_versions`` (2: version folders kept on disk: the new one, the
previous one, then the newest others), ``loaded_versions`` (1, at most ``keep_versions``: how
many of them Triton holds in memory. Why 1: Triton reloads every listed version on each load,
even one it already serves, because the version list is part of the config, so each extra
loaded version costs a full load per switch; the old version still serves until the new one is
ready), ``backend``
(``tensorrt``; ``python`` serves the host's emulated engine, an ONNX file, from a generated
``model.py`` through onnxruntime in Triton's Python backend: hosts and tests only),
``tensorrt`` (the TensorRT version Triton's tensorrt backend runs, e.g. ``8.5.2``: an engine
built with another major.minor.patch is refused, ``tensorrt_version_mismatch``; not checked
when absent), ``grpc_url`` (HOST:PORT of Triton's gRPC endpoint, default port 8001: loads and
unloads go there through ``triton_grpc``, so a load never holds a request on the HTTP endpoint
the app uses; needs the ``grpcio`` package, the ``triton`` extra; readiness and inference checks
stay on ``url``).
"""

import errno
import http.client
import json
import os
import re
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Dict, List, Mapping, Optional, Tuple

from agent.device.handoff.base import Adapter, ModelVersion, check_batch_size, dla_core
from agent.errors import AgentError
from agent.fsio import atomic_write, atomic_write_text
from agent.version_key import version_key

MAP_FILE = "jetson-agent-versions.json"
MAX_RESPONSE = 64 * 1024
MAX_MAP_BYTES = 256 * 1024
KEYS = ("repository", "url", "max_batch_size", "instance_group", "timeout_s", "keep_versions",
        "backend", "grpc_url", "loaded_versions", "tensorrt")
KINDS = {"gpu": "KIND_GPU", "cpu": "KIND_CPU", "auto": "KIND_AUTO"}
# numpy dtype name (meta.json) -> Triton data type (model_config.proto's DataType).
DTYPES = {
    "bool": "TYPE_BOOL", "uint8": "TYPE_UINT8", "uint16": "TYPE_UINT16",
    "uint32": "TYPE_UINT32", "uint64": "TYPE_UINT64", "int8": "TYPE_INT8",
    "int16": "TYPE_INT16", "int32": "TYPE_INT32", "int64": "TYPE_INT64",
    "float16": "TYPE_FP16", "float32": "TYPE_FP32", "float64": "TYPE_FP64",
    "bfloat16": "TYPE_BF16",
}
# numpy dtype name -> (KServe v2 datatype, bytes per element), for the readiness inference.
WIRE = {
    "bool": ("BOOL", 1), "uint8": ("UINT8", 1), "uint16": ("UINT16", 2), "uint32": ("UINT32", 4),
    "uint64": ("UINT64", 8), "int8": ("INT8", 1), "int16": ("INT16", 2), "int32": ("INT32", 4),
    "int64": ("INT64", 8), "float16": ("FP16", 2), "float32": ("FP32", 4),
    "float64": ("FP64", 8), "bfloat16": ("BF16", 2),
}
# No quote, backslash or control character: a name goes into config.pbtxt verbatim, and a
# trailing newline or NUL would end up in Triton's config (re.fullmatch: "$" allows a "\n").
_TENSOR_NAME = re.compile(r"[^\"\\\x00-\x1f\x7f]{1,256}")
FILE_MODE, DIR_MODE = 0o640, 0o750
MAX_WARMUP_BYTES = 64 << 20  # larger inputs: readiness is Triton's ready alone
MAX_DIMS = 16  # a warmup shape of more dimensions (TensorRT has at most 8): no warmup
HEALTH_TIMEOUT_S = 2.0
MAX_HEAL = 16  # names looked at per heal() call (a cursor: the next call takes the next ones)
HEAL_RETRY_S = 60.0  # a version Triton failed to load again is tried again after this

# Served by Triton's Python backend in ``backend: python`` mode: the version folder's
# model.plan is the host's emulated engine (ONNX), run by onnxruntime. This is the host's
# stand-in for Triton's TensorRT backend, which deserialises a plan inside Triton's process;
# here each loaded version is a stub process, so loading one costs CPU next to the version
# that serves (docs/benchmarks.md, "A real Triton switching versions under load").
PYTHON_MODEL = '''"""Generated by jetson-agent: serves this version's model.plan (the host's
emulated engine, an ONNX file) with onnxruntime inside Triton's Python backend."""

import os
import sys

# numpy only wraps tensors here (onnxruntime computes, on its own threads): without this its
# OpenBLAS starts a thread per core at import, and they spin before they sleep, about 2 s of
# CPU per load on a 16-core host, taken from the version serving. An operator's value stays.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

_unraisable = sys.unraisablehook


def _quiet_used_capsule(info):
    # The stub renames a DLPack capsule it took to "used_dlpack" (DLPack says "used_dltensor"),
    # so numpy's capsule destructor reports an error for every response: a traceback in
    # Triton's log per request. The stub frees the tensor itself; anything else is reported.
    if isinstance(info.exc_value, ValueError) and "used_dlpack" in repr(info.object):
        return
    _unraisable(info)


sys.unraisablehook = _quiet_used_capsule


def _open(path):
    # Imported here, not at the top: Triton also starts a stub per load that only reads this
    # file (its config hooks). Normal priority: a load at SCHED_IDLE could starve for as long
    # as every CPU stays busy (a load timed out on a loaded host), for no gain measured.
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    return onnxruntime.InferenceSession(path, sess_options=options,
                                        providers=["CPUExecutionProvider"])


class TritonPythonModel:
    def initialize(self, args):
        self.session = _open(os.path.join(
            args["model_repository"], args["model_version"], "model.plan"))
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]

    def execute(self, requests):
        responses = []
        for request in requests:
            # DLPack both ways: the stub's as_numpy()/Tensor(numpy) misread numpy 2 arrays.
            feeds = {n: np.from_dlpack(pb_utils.get_input_tensor_by_name(request, n))
                     for n in self.inputs}
            results = self.session.run(self.outputs, feeds)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor.from_dlpack(n, np.ascontiguousarray(r))
                for n, r in zip(self.outputs, results)]))
        return responses
'''


def _bad(where: str, key: str, expected: str, found: Any) -> AgentError:
    return AgentError("bad_config", "{}.{}: expected {}, found {!r}".format(
        where, key, expected, found))


def _number(section: Mapping[str, Any], where: str, key: str, default: Any, low: float,
            high: float, kind: type = int) -> Any:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (kind is int and not isinstance(value, int)) or not low <= value <= high:
        raise _bad(where, key, "{} {}..{}".format(
            "an integer" if kind is int else "a number", low, high), value)
    return kind(value)


def parse_url(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _bad(where, "url", "http://HOST:PORT", value)
    parsed = urllib.parse.urlsplit(value)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme not in ("http", "https") or not parsed.hostname or not port or \
            parsed.path not in ("", "/") or parsed.query or parsed.fragment or parsed.username:
        raise _bad(where, "url", "http://HOST:PORT (Triton's HTTP endpoint)", value)
    return "{}://{}".format(parsed.scheme, parsed.netloc)


def parse_grpc_url(value: Any, where: str) -> str:
    parsed = urllib.parse.urlsplit("//" + value) if isinstance(value, str) else None
    try:
        port = parsed.port if parsed is not None else None
    except ValueError:
        port = None
    if parsed is None or not parsed.hostname or not port or parsed.path or parsed.query or \
            parsed.username or parsed.fragment:
        raise _bad(where, "grpc_url", "HOST:PORT (Triton's gRPC endpoint)", value)
    try:
        import agent.device.handoff.triton_grpc  # noqa: F401 - grpcio is there
    except ImportError:
        raise _bad(where, "grpc_url", "the grpcio package installed (pip install "
                   "'jetson-agent[triton]') for Triton's gRPC endpoint", value)
    return parsed.netloc


def from_config(section: Mapping[str, Any], where: str) -> "TritonAdapter":
    unknown = sorted(set(section) - set(KEYS))
    if unknown:
        raise _bad(where, unknown[0], "one of " + ", ".join(KEYS), unknown[0])
    repository = section.get("repository")
    if not isinstance(repository, str) or not repository.strip():
        raise _bad(where, "repository", "the model repository's directory", repository)
    url = parse_url(section["url"], where) if section.get("url") is not None else None
    grpc_url = parse_grpc_url(section["grpc_url"], where) \
        if section.get("grpc_url") is not None else None
    if grpc_url is not None and url is None:
        raise _bad(where, "url", "http://HOST:PORT with grpc_url (readiness and inference "
                   "checks use HTTP)", None)
    group = section.get("instance_group")
    instance: Optional[Tuple[str, int]] = None
    if group is not None:
        if not isinstance(group, Mapping) or set(group) - {"kind", "count"}:
            raise _bad(where, "instance_group", "{kind: gpu|cpu|auto, count: N}", group)
        kind = group.get("kind", "gpu")
        if kind not in KINDS:
            raise _bad(where, "instance_group.kind", "gpu, cpu or auto", kind)
        instance = (KINDS[kind], _number(group, where, "instance_group.count",
                                         group.get("count", 1), 1, 64))
    backend = section.get("backend", "tensorrt")
    if backend not in ("tensorrt", "python"):
        raise _bad(where, "backend", "tensorrt (or python: hosts and tests)", backend)
    tensorrt = section.get("tensorrt")
    if tensorrt is not None and not (isinstance(tensorrt, str)
                                     and re.match(r"^\d+\.\d+(\.\d+)*$", tensorrt)):
        raise _bad(where, "tensorrt", "the TensorRT version Triton's tensorrt backend runs, "
                   "e.g. 8.5.2", tensorrt)
    keep = _number(section, where, "keep_versions", 2, 1, 16)
    loaded = _number(section, where, "loaded_versions", 1, 1, 16)
    if loaded > keep:
        raise _bad(where, "loaded_versions", "at most keep_versions ({})".format(keep), loaded)
    return TritonAdapter(
        repository=os.path.abspath(repository), url=url,
        max_batch_size=_number(section, where, "max_batch_size", 0, 0, 1 << 20),
        instance_group=instance,
        timeout_s=_number(section, where, "timeout_s", 60.0, 0.1, 3600.0, float),
        keep_versions=keep, loaded_versions=loaded, backend=backend, grpc_url=grpc_url,
        tensorrt=tensorrt)


def _release(version: str) -> Tuple[int, ...]:
    """major.minor.patch of a TensorRT version (a build number after them does not count)."""
    return version_key(version)[:3]


def _dims(tensor: Mapping[str, Any], max_batch_size: int, what: str) -> List[int]:
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not shape:
        raise AgentError("handoff_failed", "{}: expected a shape list, found {!r}".format(
            what, shape))
    dims = []
    for d in shape:
        if d is None or (isinstance(d, int) and not isinstance(d, bool) and d < 0) or \
                isinstance(d, str):
            dims.append(-1)
        elif isinstance(d, int) and not isinstance(d, bool):
            dims.append(d)
        else:
            raise AgentError("handoff_failed", "{}: expected integer dims, found {!r}".format(
                what, shape))
    if max_batch_size > 0:
        if dims[0] != -1:
            raise AgentError("handoff_failed", (
                "{}: max_batch_size {} expects a dynamic first (batch) dimension, found shape "
                "{}").format(what, max_batch_size, shape))
        dims = dims[1:]
        if not dims:
            raise AgentError("handoff_failed", "{}: expected dims besides the batch dimension, "
                             "found shape {}".format(what, shape))
    return dims


def check_tensor_name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _TENSOR_NAME.fullmatch(value):
        raise AgentError("bad_tensor_name", "{}: expected a tensor name (1-256 characters, no "
                         "quote, backslash or control character), found {!r}".format(what, value))
    return value


def tensors(name: str, meta: Mapping[str, Any], max_batch_size: int = 0
            ) -> Dict[str, List[Tuple[str, str, List[int]]]]:
    """{"input": [(name, Triton data type, dims)], "output": [...]} from ``meta.json``."""
    out: Dict[str, List[Tuple[str, str, List[int]]]] = {}
    for section in ("input", "output"):
        found = meta.get(section + "s")
        if not isinstance(found, list) or not found or len(found) > 256:
            raise AgentError("handoff_failed", "meta.json of {}: expected a non-empty {}s list "
                             "(at most 256), found {!r}".format(name, section, found))
        entries = []
        for tensor in found:
            what = "meta.json of {}: {} {!r}".format(name, section, (tensor or {}).get("name")
                                                     if isinstance(tensor, dict) else tensor)
            if not isinstance(tensor, dict):
                raise AgentError("bad_tensor_name", "{}: expected a tensor name, found "
                                 "{!r}".format(what, tensor))
            tname = check_tensor_name(tensor.get("name"), what)
            dtype = DTYPES.get(str(tensor.get("dtype")))
            if dtype is None:
                raise AgentError("handoff_failed", "{}: expected a dtype Triton knows ({}), "
                                 "found {!r}".format(what, ", ".join(DTYPES), tensor.get("dtype")))
            entries.append((tname, dtype, _dims(tensor, max_batch_size, what)))
        out[section] = entries
    return out


def render_config(name: str, meta: Mapping[str, Any], versions: List[int], max_batch_size: int = 0,
                  instance_group: Optional[Tuple[str, int]] = None,
                  backend: str = "tensorrt") -> str:
    """config.pbtxt (protobuf text format of Triton's ModelConfig) for ``name``'s meta.json."""
    lines = ['name: "{}"'.format(name)]
    lines.append('platform: "tensorrt_plan"' if backend == "tensorrt" else 'backend: "python"')
    lines.append("max_batch_size: {}".format(max_batch_size))
    for section, entries in tensors(name, meta, max_batch_size).items():
        lines.append("{} [\n{}\n]".format(section, ",\n".join(
            "  {{\n    name: \"{}\"\n    data_type: {}\n    dims: [ {} ]\n  }}".format(
                tname, dtype, ", ".join(str(d) for d in dims)) for tname, dtype, dims in entries)))
    lines.append("version_policy: {{ specific: {{ versions: [ {} ] }} }}".format(
        ", ".join(str(v) for v in sorted(versions))))
    group, core = _instances(meta, instance_group)
    if group is not None:
        dla = "" if core is None else (
            "\n    secondary_devices [ {{ kind: KIND_NVDLA device_id: {} }} ]".format(core))
        lines.append("instance_group [\n  {{\n    count: {}\n    kind: {}{}\n  }}\n]".format(
            group[1], group[0], dla))
    warmup = warmup_entry(meta, max_batch_size)
    if warmup:
        samples = "\n".join(
            "    inputs {{\n      key: \"{}\"\n      value: {{\n        data_type: {}\n"
            "        dims: [ {} ]\n        zero_data: true\n      }}\n    }}".format(
                tname, dtype, ", ".join(str(d) for d in dims)) for tname, dtype, dims in warmup)
        lines.append('model_warmup [\n  {{\n    name: "zeros"\n    batch_size: 1\n{}\n  }}\n]'
                     .format(samples))
    return "\n".join(lines) + "\n"


def _instances(meta: Mapping[str, Any], instance_group: Optional[Tuple[str, int]]
               ) -> Tuple[Optional[Tuple[str, int]], Optional[int]]:
    """The instance group and the DLA core: an engine built for a DLA core runs as a GPU
    instance with the core as its secondary device (model_config.proto: KIND_NVDLA)."""
    core = dla_core(meta)
    if core is None:
        return instance_group, None
    return ("KIND_GPU", instance_group[1] if instance_group else 1), core


def config_doc(name: str, meta: Mapping[str, Any], versions: List[int], max_batch_size: int = 0,
               instance_group: Optional[Tuple[str, int]] = None,
               backend: str = "tensorrt") -> Dict[str, Any]:
    """The same ModelConfig as ``render_config``, as the JSON the load API's ``config``
    parameter takes."""
    doc: Dict[str, Any] = {"name": name, "max_batch_size": max_batch_size}
    if backend == "tensorrt":
        doc["platform"] = "tensorrt_plan"
    else:
        doc["backend"] = "python"
    for section, entries in tensors(name, meta, max_batch_size).items():
        doc[section] = [{"name": t, "data_type": d, "dims": dims} for t, d, dims in entries]
    doc["version_policy"] = {"specific": {"versions": sorted(versions)}}
    group, core = _instances(meta, instance_group)
    if group is not None:
        doc["instance_group"] = [{"count": group[1], "kind": group[0]}]
        if core is not None:
            doc["instance_group"][0]["secondary_devices"] = [{"kind": "KIND_NVDLA",
                                                              "device_id": core}]
    warmup = warmup_entry(meta, max_batch_size)
    if warmup:
        doc["model_warmup"] = [{"name": "zeros", "batch_size": 1, "inputs": {
            tname: {"data_type": dtype, "dims": dims, "zero_data": True}
            for tname, dtype, dims in warmup}}]
    return doc


def warmup_inputs(meta: Mapping[str, Any]) -> Optional[List[Tuple[str, str, List[int]]]]:
    """(name, numpy dtype, shape) of each input of one request of zeros: the optimisation
    profile's ``opt`` shape where meta.json has one (a TensorRT plan refuses shapes outside its
    profile), else the shape with dynamic dimensions at 1; None when the inputs are larger than
    MAX_WARMUP_BYTES or of a type the wire has no size for."""
    profiles = meta.get("profiles")
    profile = profiles[0].get("inputs") if isinstance(profiles, list) and profiles and \
        isinstance(profiles[0], dict) else None
    out, total = [], 0
    for tensor in meta.get("inputs") or []:
        dtype = str(tensor.get("dtype"))
        if dtype not in WIRE:
            return None
        entry = profile.get(tensor.get("name")) if isinstance(profile, dict) else None
        opt = entry.get("opt") if isinstance(entry, dict) else None
        given = opt if isinstance(opt, list) and opt else tensor.get("shape") or []
        if not isinstance(given, list) or len(given) > MAX_DIMS:
            return None
        shape = [d if isinstance(d, int) and not isinstance(d, bool) and d > 0 else 1
                 for d in given]
        count = 1
        for d in shape:
            count *= d
        total += count * WIRE[dtype][1]
        if total > MAX_WARMUP_BYTES:
            return None
        out.append((tensor["name"], dtype, shape))
    return out


def warmup_request(meta: Mapping[str, Any]) -> Optional[Tuple[bytes, int]]:
    """One inference request of zeros for ``meta.json``'s inputs (``warmup_inputs``), in the
    KServe v2 binary tensor form: (body, JSON header length); None where warmup_inputs is."""
    found = warmup_inputs(meta)
    if found is None:
        return None
    inputs, blobs = [], []
    for name, dtype, shape in found:
        size = WIRE[dtype][1]
        for d in shape:
            size *= d
        inputs.append({"name": name, "shape": shape, "datatype": WIRE[dtype][0],
                       "parameters": {"binary_data_size": size}})
        blobs.append(size)
    outputs = [{"name": t["name"], "parameters": {"binary_data": True}}
               for t in meta.get("outputs") or []]
    header = json.dumps({"inputs": inputs, "outputs": outputs}).encode("utf-8")
    return header + b"\0" * sum(blobs), len(header)


def warmup_entry(meta: Mapping[str, Any], max_batch_size: int
                 ) -> Optional[List[Tuple[str, str, List[int]]]]:
    """The inputs of config.pbtxt's ``model_warmup`` sample: (name, Triton data type, dims),
    ``warmup_inputs`` without the batch dimension when max_batch_size > 0 (batch_size 1).
    Triton runs it on each loaded version before calling it ready, so the first request of
    the app is not the one that pays the engine's first run. None: no warmup sample."""
    found = warmup_inputs(meta)
    if not found:
        return None
    return [(name, DTYPES[dtype], shape[1:] if max_batch_size > 0 else shape)
            for name, dtype, shape in found]


class TritonAdapter(Adapter):
    kind = "triton"

    def __init__(self, repository: str, url: Optional[str] = None, max_batch_size: int = 0,
                 instance_group: Optional[Tuple[str, int]] = None, timeout_s: float = 60.0,
                 keep_versions: int = 2, backend: str = "tensorrt",
                 poll_s: float = 0.1, grpc_url: Optional[str] = None,
                 loaded_versions: int = 1, tensorrt: Optional[str] = None) -> None:
        self.repository = repository
        self.tensorrt = tensorrt  # what Triton's tensorrt backend runs (None: not checked)
        self.url = url
        self.grpc_url = grpc_url
        self.max_batch_size = max_batch_size
        self.instance_group = instance_group
        self.timeout_s = timeout_s
        self.keep_versions = keep_versions
        self.loaded_versions = min(loaded_versions, keep_versions)
        self.backend = backend
        self.poll_s = poll_s
        self.load_errors: Dict[Tuple[str, int], str] = {}
        # heal() skips a round while a switch or revert of this adapter runs.
        self._busy = threading.Lock()
        self.was_live: Optional[bool] = None  # Triton's liveness at the last heal()
        self._heal_cursor = 0
        self._heal_failed: Dict[Tuple[str, int], float] = {}  # (name, number) -> retry at
        # No proxy for Triton: it is on this device (or next to it).
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # -- the repository on disk --------------------------------------------------------------
    def model_dir(self, name: str) -> str:
        return os.path.join(self.repository, name)

    def read_map(self, name: str) -> List[Dict[str, Any]]:
        """The N -> version entries, oldest first (empty when there is no file yet)."""
        path = os.path.join(self.model_dir(name), MAP_FILE)
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_MAP_BYTES + 1)
        except FileNotFoundError:
            return []
        entries: Any = None
        if len(data) <= MAX_MAP_BYTES:
            try:
                doc = json.loads(data.decode("utf-8"))
                entries = doc.get("versions") if isinstance(doc, dict) else None
            except ValueError:
                pass
        if isinstance(entries, list):
            return [e for e in entries if isinstance(e, dict) and isinstance(e.get("triton"), int)
                    and isinstance(e.get("version"), str)]
        raise AgentError("handoff_failed", "{}: expected the JSON version map (at most {} "
                             "bytes), found something else".format(path, MAX_MAP_BYTES))

    def _write_map(self, name: str, entries: List[Dict[str, Any]]) -> None:
        atomic_write(os.path.join(self.model_dir(name), MAP_FILE), (json.dumps(
            {"model": name, "versions": entries}, indent=1, sort_keys=True) + "\n").encode(),
            FILE_MODE)

    def _on_disk(self, name: str) -> List[int]:
        try:
            names = os.listdir(self.model_dir(name))
        except FileNotFoundError:
            return []
        return sorted(int(n) for n in names if n.isdigit() and
                      os.path.isdir(os.path.join(self.model_dir(name), n)))

    def triton_version(self, name: str, version: str) -> Optional[int]:
        """The newest Triton version N holding our ``version`` (None if none is on disk)."""
        present = set(self._on_disk(name))
        found = [e["triton"] for e in self.read_map(name)
                 if e["version"] == version and e["triton"] in present]
        return max(found) if found else None

    def _place_engine(self, engine: str, target: str) -> None:
        try:
            os.link(engine, target)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            shutil.copyfile(engine, target)

    def _add_version(self, new: ModelVersion) -> int:
        model_dir = self.model_dir(new.name)
        if not os.path.isdir(model_dir):
            os.makedirs(model_dir, exist_ok=True)
            os.chmod(model_dir, DIR_MODE)
        entries = self.read_map(new.name)
        number = max([0] + [e["triton"] for e in entries] + self._on_disk(new.name)) + 1
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=model_dir)  # not a number: Triton skips it
        try:
            if not os.path.isfile(new.engine):
                raise AgentError("handoff_failed", "expected the engine of {}@{} at {}, found "
                                 "none".format(new.name, new.version, new.engine))
            self._place_engine(new.engine, os.path.join(tmp, "model.plan"))
            meta = dict(new.meta, triton={"model": new.name, "version": number,
                                          "repository": self.repository})
            atomic_write_text(os.path.join(tmp, "meta.json"),
                              json.dumps(meta, indent=1, sort_keys=True) + "\n")
            if self.backend == "python":
                atomic_write_text(os.path.join(tmp, "model.py"), PYTHON_MODEL)
            for path in os.listdir(tmp):
                os.chmod(os.path.join(tmp, path), FILE_MODE)
            os.chmod(tmp, DIR_MODE)
            os.rename(tmp, os.path.join(model_dir, str(number)))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        entries.append({"triton": number, "version": new.version,
                        "model_sha256": new.meta.get("model_sha256"),
                        "engine_sha256": new.meta.get("engine_sha256"),
                        "added": round(time.time(), 3)})
        self._write_map(new.name, entries)
        return number

    def _write_config(self, new: ModelVersion, versions: List[int]) -> None:
        atomic_write(os.path.join(self.model_dir(new.name), "config.pbtxt"), render_config(
            new.name, new.meta, versions, self.max_batch_size, self.instance_group,
            self.backend).encode("utf-8"), FILE_MODE)

    def _config_json(self, new: ModelVersion, versions: List[int]) -> str:
        return json.dumps(config_doc(new.name, new.meta, versions, self.max_batch_size,
                                     self.instance_group, self.backend), sort_keys=True)

    def _prune(self, name: str, keep: List[int]) -> None:
        """Remove the version folders config.pbtxt no longer lists (and their map entries)."""
        for number in self._on_disk(name):
            if number not in keep:
                shutil.rmtree(os.path.join(self.model_dir(name), str(number)), ignore_errors=True)
        entries = self.read_map(name)
        kept = [e for e in entries if e["triton"] in keep]
        if kept != entries:
            self._write_map(name, kept)

    # -- Triton's HTTP API -------------------------------------------------------------------
    def _request(self, method: str, path: str, timeout: float, body: Optional[bytes] = None,
                 headers: Optional[Dict[str, str]] = None) -> Tuple[int, str]:
        assert self.url is not None
        data = (body if body is not None else b"") if method == "POST" else None
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers=headers or {})
        try:
            with self._opener.open(request, timeout=timeout) as response:
                return response.status, response.read(MAX_RESPONSE).decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            text = exc.read(MAX_RESPONSE).decode("utf-8", "replace")
            exc.close()
            return exc.code, text
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise AgentError("handoff_failed", "expected Triton to answer {} {}{}, found {}".format(
                method, self.url, path, getattr(exc, "reason", exc)))

    @staticmethod
    def _error_text(body: str) -> str:
        try:
            doc = json.loads(body)
            if isinstance(doc, dict) and isinstance(doc.get("error"), str):
                return doc["error"][:500]
        except ValueError:
            pass
        return body.strip()[:500]

    def _load(self, name: str, config: Optional[str] = None) -> Optional[str]:
        """POST load (with ``config``: the load API's config override, so Triton loads what we
        give it without rereading config.pbtxt); the error text when Triton refused it (None
        when it loaded)."""
        if self.grpc_url is not None:
            from agent.device.handoff import triton_grpc
            return triton_grpc.call(self.grpc_url, "RepositoryModelLoad", name, config,
                                    self.timeout_s)
        quoted = urllib.parse.quote(name, safe="")
        doc = None if config is None else json.dumps({"parameters": {"config": config}}).encode()
        status, body = self._request("POST", "/v2/repository/models/{}/load".format(quoted),
                                     self.timeout_s, doc,
                                     {"Content-Type": "application/json"} if doc else None)
        return None if status == 200 else "HTTP {}: {}".format(status, self._error_text(body))

    def _unload(self, name: str) -> Optional[str]:
        if self.grpc_url is not None:
            from agent.device.handoff import triton_grpc
            return triton_grpc.call(self.grpc_url, "RepositoryModelUnload", name, None,
                                    self.timeout_s)
        status, body = self._request("POST", "/v2/repository/models/{}/unload".format(
            urllib.parse.quote(name, safe="")), self.timeout_s)
        return None if status == 200 else "HTTP {}: {}".format(status, self._error_text(body))

    def ready(self, name: str, number: int) -> bool:
        status, _body = self._request("GET", "/v2/models/{}/versions/{}/ready".format(
            urllib.parse.quote(name, safe=""), number), min(self.timeout_s, 10.0))
        return status == 200

    def live(self) -> bool:
        """``GET /v2/health/live`` answers 200 (False when Triton does not answer)."""
        try:
            status, _body = self._request("GET", "/v2/health/live",
                                          min(self.timeout_s, HEALTH_TIMEOUT_S))
        except AgentError:
            return False
        return status == 200

    def infer_check(self, new: ModelVersion, number: int) -> Optional[str]:
        """One request of zeros through Triton to version ``number``: None when it answered,
        else Triton's error text. Skipped (None) for inputs too large to send."""
        request = warmup_request(new.meta)
        if request is None:
            return None
        body, header_length = request
        status, text = self._request(
            "POST", "/v2/models/{}/versions/{}/infer".format(
                urllib.parse.quote(new.name, safe=""), number), self.timeout_s, body,
            {"Content-Type": "application/octet-stream",
             "Inference-Header-Content-Length": str(header_length)})
        return None if status == 200 else "HTTP {}: {}".format(status, self._error_text(text))

    # -- the adapter steps -------------------------------------------------------------------
    def prepare(self, new: ModelVersion, previous: Optional[ModelVersion]) -> None:
        render_config(new.name, new.meta, [1], self.max_batch_size, self.instance_group,
                      self.backend)  # refuse a meta.json Triton can't describe before any write
        if self.max_batch_size > 0:
            check_batch_size(new, self.max_batch_size, "max_batch_size")
        if self.backend == "tensorrt":
            self._check_tensorrt(new)
        try:
            self._add_version(new)
        except OSError as exc:
            raise AgentError("handoff_failed", "expected to write {}'s Triton version folder "
                             "under {}, found {}".format(new.name, self.repository, exc))

    def _check_tensorrt(self, new: ModelVersion) -> None:
        """``tensorrt_version_mismatch`` when Triton's TensorRT is not the engine's: a plan
        loads only under the TensorRT major.minor.patch it was built with (Triton's docs)."""
        built = str((new.meta.get("portability") or {}).get("tensorrt") or
                    new.meta.get("tensorrt") or "")
        if not self.tensorrt or not built:
            return
        if _release(built) != _release(self.tensorrt):
            raise AgentError(
                "tensorrt_version_mismatch",
                "{}@{}: the engine was built with TensorRT {}, Triton's tensorrt backend runs "
                "{} (handoff tensorrt); expected the same major.minor.patch: rebuild the "
                "engine under Triton's TensorRT or run a Triton built with {}".format(
                    new.name, new.version, built, self.tensorrt, built),
                {"engine": built, "triton": self.tensorrt})

    def _kept(self, new_number: int, name: str, previous: Optional[ModelVersion],
              exclude: Optional[str] = None, pending: bool = False) -> List[int]:
        """The version folders kept on disk, most wanted first: the new one, the previous one,
        then the newest others, one folder per version and never version ``exclude`` (being
        reverted): keep_versions of them. A ``pending`` new one (switching, not yet committed)
        does not count: it may yet be refused, and every rollback target must still be there
        then; ``commit`` prunes to keep_versions. The first loaded_versions of them are the
        ones Triton holds (``_loaded``)."""
        entries = self.read_map(name)
        version_of = {e["triton"]: e["version"] for e in entries}
        present = set(self._on_disk(name))
        limit = self.keep_versions + (1 if pending else 0)
        kept, seen = [new_number], {version_of.get(new_number), exclude}
        wanted = [self.triton_version(name, previous.version)] if previous is not None else []
        wanted += [e["triton"] for e in sorted(entries, key=lambda e: -e["triton"])]
        for number in wanted:
            if len(kept) >= limit:
                break
            if number in present and version_of.get(number) not in seen:
                kept.append(number)
                seen.add(version_of.get(number))
        return kept

    def _loaded(self, kept: List[int]) -> List[int]:
        return sorted(kept[:self.loaded_versions])

    def switch(self, new: ModelVersion, previous: Optional[ModelVersion]) -> None:
        number = self.triton_version(new.name, new.version)
        if number is None:
            raise AgentError("handoff_failed", "expected a prepared Triton version of {}@{} "
                             "under {}, found none".format(new.name, new.version,
                                                           self.model_dir(new.name)))
        with self._busy:
            kept = self._kept(number, new.name, previous, pending=True)
            listed = self._loaded(kept)
            self.load_errors.pop((new.name, number), None)
            if self.url is None:
                self._write_config(new, listed)
            else:
                # The load API's config override: Triton loads the new version beside the ones
                # it serves, which answer until it is ready; config.pbtxt follows for its next
                # start (explicit mode rereads it on a load without config: heal()).
                error = self._load(new.name, self._config_json(new, listed))
                if error is not None:
                    self.load_errors[(new.name, number)] = error
                else:
                    self._write_config(new, listed)
            self._prune(new.name, kept)

    def confirm(self, new: ModelVersion) -> Optional[bool]:
        if self.url is None:
            return None  # poll mode: the app (or a probe) says whether it serves
        number = self.triton_version(new.name, new.version)
        if number is None:
            return False
        if (new.name, number) in self.load_errors:
            raise AgentError("handoff_failed", "expected Triton to load {}@{} (version {}), "
                             "found {}".format(new.name, new.version, number,
                                               self.load_errors[(new.name, number)]))
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                if self.ready(new.name, number):
                    break
            except AgentError:
                pass  # Triton restarting: keep asking until the deadline
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.poll_s)
        # Ready means loaded; one request through the server says it serves.
        error = self.infer_check(new, number)
        if error is not None:
            self.load_errors[(new.name, number)] = error
            raise AgentError("handoff_failed", "expected Triton to answer an inference request "
                             "of zeros on {}@{} (version {}), found {}".format(
                                 new.name, new.version, number, error))
        return True

    def commit(self, new: ModelVersion, previous: Optional[ModelVersion]) -> None:
        """``new`` is committed: the repository keeps keep_versions folders, ``new`` counted
        (only folders config.pbtxt does not list go: Triton does not hold them)."""
        number = self.triton_version(new.name, new.version)
        if number is not None:
            self._prune(new.name, self._kept(number, new.name, previous))

    def last_error(self, new: ModelVersion) -> Optional[str]:
        number = self.triton_version(new.name, new.version)
        return self.load_errors.get((new.name, number)) if number is not None else None

    def revert(self, previous: Optional[ModelVersion], failed: ModelVersion) -> None:
        with self._busy:
            self._revert(previous, failed)

    def _revert(self, previous: Optional[ModelVersion], failed: ModelVersion) -> None:
        name = failed.name
        if previous is None:
            if self.url is not None:
                error = self._unload(name)
                if error is not None:
                    raise AgentError("handoff_failed", "expected Triton to unload {}, found "
                                     "{}".format(name, error))
            shutil.rmtree(self.model_dir(name), ignore_errors=True)
            return
        number = self.triton_version(name, previous.version)
        if number is None:
            number = self._add_version(previous)
        # The failed version goes; the other kept ones stay on disk as rollback targets.
        kept = self._kept(number, name, None, exclude=failed.version)
        listed = self._loaded(kept)
        if self.url is not None:
            error = self._load(name, self._config_json(previous, listed))
            if error is not None:
                raise AgentError("handoff_failed", "expected Triton to load {}@{} (version {}) "
                                 "again, found {}".format(name, previous.version, number, error))
        self._write_config(previous, listed)
        self._prune(name, kept)

    def heal(self, committed: List[ModelVersion]) -> Dict[str, str]:
        """Load again the ``committed`` versions Triton does not report ready (a restart in
        explicit mode loads nothing). {name: what happened} for each name acted on; {} when
        all are ready, Triton is down (nothing to load into: the next call tries again) or a
        switch of this adapter is running. Bounded: MAX_HEAL names, short timeouts."""
        if self.url is None or not committed or not self._busy.acquire(blocking=False):
            return {}
        try:
            live = self.live()
            restarted = live and self.was_live is False
            self.was_live = live
            if not live:
                return {}
            out: Dict[str, str] = {}
            start = self._heal_cursor % len(committed)
            turn = (committed[start:] + committed[:start])[:MAX_HEAL]
            self._heal_cursor = start + len(turn)
            now = time.monotonic()
            for version in turn:
                number = self.triton_version(version.name, version.version)
                if number is None or self._heal_failed.get((version.name, number), 0) > now:
                    continue
                try:
                    if self.ready(version.name, number):
                        continue
                    # config.pbtxt lists what was loaded with it (the committed version, and
                    # kept ones with loaded_versions above 1): a load without config rereads it.
                    error = self._load(version.name)
                except AgentError as exc:
                    error = exc.message
                if error is not None:  # not every 5 s: a load can take its whole timeout
                    self._heal_failed[(version.name, number)] = now + HEAL_RETRY_S
                    while len(self._heal_failed) > 4 * MAX_HEAL:
                        self._heal_failed.pop(next(iter(self._heal_failed)))
                when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                cause = "after a Triton restart" if restarted else "(Triton did not have it)"
                out[version.name] = (
                    "{}@{} (Triton version {}) loaded again {} at {}".format(
                        version.name, version.version, number, cause, when)
                    if error is None else
                    "{}@{} (Triton version {}) not loaded {}: {}".format(
                        version.name, version.version, number, cause, error))[:500]
            return out
        finally:
            self._busy.release()
