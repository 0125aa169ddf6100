"""TensorRT plugins a model needs: which ONNX nodes are plugin ops (no host runtime has them),
and the plugin libraries (``.so``) a build may load.

A model exported for TensorRT (YOLO / TAO detectors with ``EfficientNMS_TRT``, custom layers)
names ops that only TensorRT's plugin registry implements: the standard ones come with
TensorRT (``init_libnvinfer_plugins``), others from a library shipped with the model. Such a
library runs native code inside the worker, so it is treated like the model itself: pinned by
its SHA-256, loaded only from the models directory (a path elsewhere is refused, symlinks
resolved first), at most ``MAX_PLUGINS`` of at most ``MAX_PLUGIN_BYTES`` each.

Worker side: Python >= 3.6.
"""

import hashlib
import os
from typing import Any, Dict, List, Sequence, Tuple

from agent.errors import AgentError

MAX_PLUGINS = 8
MAX_PLUGIN_BYTES = 256 << 20
# ONNX domains a host runtime implements; an op in any other domain is a plugin op.
STANDARD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml", "com.microsoft")
# TensorRT's standard plugins seen in exported models (TensorRT's plugin/README.md): named
# in the default domain, so the domain alone does not tell them apart. Any op ending in
# "_TRT" is TensorRT's naming for its plugins, too.
KNOWN_TRT_PLUGINS = ("EfficientNMS_TRT", "EfficientNMS_ONNX_TRT", "BatchedNMS_TRT",
                     "BatchedNMSDynamic_TRT", "NMS_TRT", "NMSDynamic_TRT",
                     "MultilevelCropAndResize_TRT", "MultilevelProposeROI_TRT",
                     "PyramidROIAlign_TRT", "ROIAlign_TRT", "InstanceNormalization_TRT",
                     "GroupNormalizationPlugin", "ResizeNearest_TRT", "DecodeBbox3DPlugin",
                     "DisentangledAttention_TRT", "CustomEmbLayerNormPluginDynamic",
                     "CustomSkipLayerNormPluginDynamic", "CustomQKVToContextPluginDynamic",
                     "CustomGeluPluginDynamic", "RegionTRT", "Reorg_TRT", "GridAnchor_TRT")


def is_plugin_op(op_type: str, domain: str) -> bool:
    if (domain or "") not in STANDARD_DOMAINS:
        return True
    return op_type in KNOWN_TRT_PLUGINS or op_type.endswith("_TRT")


def plugin_nodes(model: Any) -> List[Tuple[str, str, str]]:
    """(node name, op type, domain) of every plugin op in ``model`` (an ONNX ModelProto),
    subgraphs included."""
    out: List[Tuple[str, str, str]] = []

    def walk(graph: Any) -> None:
        for node in graph.node:
            if is_plugin_op(node.op_type, node.domain):
                out.append((node.name or node.op_type, node.op_type, node.domain or ""))
            for attr in node.attribute:
                if attr.HasField("g"):
                    walk(attr.g)
                for sub in attr.graphs:
                    walk(sub)

    walk(model.graph)
    return out


def refuse_on_host(model: Any, model_path: str) -> None:
    """``plugin_op_on_host`` naming the plugin ops of ``model``: the host backend cannot
    emulate them (their code is TensorRT's or a shipped library's); the device decides."""
    found = plugin_nodes(model)
    if not found:
        return
    names = ["{} ({}{})".format(n, op, " in domain " + d if d else "") for n, op, d in found]
    raise AgentError(
        "plugin_op_on_host",
        "{} needs TensorRT plugin op(s) {}: the host backend (onnxruntime) cannot emulate "
        "them; expected standard ONNX ops. Build it with --backend tensorrt on the device "
        "(with --plugin LIB.so for a plugin outside TensorRT's standard library): the "
        "device's check decides".format(model_path, ", ".join(names[:10])),
        {"plugin_ops": [{"node": n, "op": op, "domain": d} for n, op, d in found[:100]]})


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_library(path: str, models_dir: str) -> Dict[str, str]:
    """A plugin library given by the user (``build --plugin``) or a job: refused
    (``plugin_path_refused``) unless it is a regular file inside ``models_dir`` (after
    resolving symlinks) of at most ``MAX_PLUGIN_BYTES``. Returns ``{path, sha256}``."""
    real = os.path.realpath(path)
    root = os.path.realpath(models_dir)
    if os.path.commonpath([real, root]) != root or real == root:
        raise AgentError(
            "plugin_path_refused",
            "plugin library {}: expected a file inside the models directory {}, found {}; "
            "copy it there (plugin code runs inside the agent's worker)".format(
                path, root, real), {"path": real, "models_dir": root})
    if not os.path.isfile(real):
        raise AgentError("file_not_found",
                         "plugin library {} does not exist (expected a .so file)".format(path))
    size = os.path.getsize(real)
    if size > MAX_PLUGIN_BYTES:
        raise AgentError("plugin_path_refused", "plugin library {}: expected at most {} MiB, "
                         "found {} MiB".format(path, MAX_PLUGIN_BYTES >> 20, size >> 20))
    return {"path": real, "sha256": sha256_of(real)}


def check_libraries(paths: Sequence[str], models_dir: str) -> List[Dict[str, str]]:
    if len(paths) > MAX_PLUGINS:
        raise AgentError("bad_argument", "expected at most {} plugin libraries, found "
                         "{}".format(MAX_PLUGINS, len(paths)))
    return [check_library(p, models_dir) for p in paths]


def verify_pinned(entry: Dict[str, str]) -> str:
    """The path of a plan's plugin entry once its content still has the pinned SHA-256
    (``plugin_digest_mismatch`` otherwise: the file changed since the plan was made)."""
    path, want = str(entry.get("path") or ""), str(entry.get("sha256") or "").lower()
    if not os.path.isfile(path):
        raise AgentError("file_not_found", "plugin library {} does not exist".format(path))
    found = sha256_of(path)
    if found != want:
        raise AgentError("plugin_digest_mismatch",
                         "plugin library {}: expected sha256 {}, found {}".format(
                             path, want, found), {"path": path})
    return path


def install_library(source: str, sha256: str, models_dir: str) -> Dict[str, str]:
    """A job's ``plugin`` artifact (its SHA-256 already checked by the artifact store) put
    where plugin libraries may be loaded from and the app can read them:
    ``<models_dir>/plugins/<sha256>.so``, written atomically (kept when already there)."""
    from agent.fsio import atomic_write

    folder = os.path.join(models_dir, "plugins")
    os.makedirs(folder, mode=0o750, exist_ok=True)
    target = os.path.join(folder, "{}.so".format(sha256))
    if not (os.path.isfile(target) and sha256_of(target) == sha256):
        with open(source, "rb") as f:
            data = f.read(MAX_PLUGIN_BYTES + 1)
        if len(data) > MAX_PLUGIN_BYTES:
            raise AgentError("plugin_path_refused", "plugin artifact: expected at most {} MiB, "
                             "found more".format(MAX_PLUGIN_BYTES >> 20))
        atomic_write(target, data, mode=0o640)  # the models group (the app) reads it
    entry = check_library(target, models_dir)
    if entry["sha256"] != sha256:
        raise AgentError("plugin_digest_mismatch", "plugin artifact {}: expected sha256 {}, "
                         "found {}".format(target, sha256, entry["sha256"]))
    return entry
