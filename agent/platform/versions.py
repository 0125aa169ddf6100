"""CUDA, TensorRT, cuDNN and JetPack versions: from files on the device, dpkg, installed Python
distributions and the matrix's JetPack release table; and whether TensorRT still supports the
GPU's compute capability."""

from typing import Any, Dict, Optional

from agent.platform.info import PlatformInfo
from agent.platform.parsers import (
    _VERSION_RE,
    CUDA_VERSION_FILES,
    CUDNN_HEADERS,
    DPKG_STATUS_FILE,
    TENSORRT_HEADERS,
    parse_cuda_version_file,
    parse_dpkg_status,
    parse_version_header,
    upstream_version,
)
from agent.platform.tree import _path, _read_text
from agent.version_key import version_key


def dist_version(name: str) -> Optional[str]:
    """An installed distribution's version without importing it (Python >= 3.8)."""
    try:
        from importlib import metadata  # novermin  (3.8+; absent on 3.6, handled)
    except ImportError:
        return None
    try:
        return metadata.version(name)
    except Exception:  # noqa: BLE001 - any metadata problem means "unknown"
        return None


def _detect_versions(info: PlatformInfo, root: str, live: bool) -> None:
    """CUDA / TensorRT / cuDNN from files on the device; the JetPack table fills the gaps."""
    def found(what: str, version: Optional[str], source: str) -> None:
        current = getattr(info, what)
        # A more precise reading of the same version wins (dpkg's libnvinfer8 says 8.2.1,
        # its tensorrt package 8.2.1.8): engine caches are tied to the exact version.
        if version and (not current or version.startswith(current + ".")):
            setattr(info, what, version)
            info.versions_source[what] = source

    for rel in CUDA_VERSION_FILES:
        text = _read_text(root, rel)
        if text:
            found("cuda", parse_cuda_version_file(rel, text), "file:/" + rel)
    for rel in TENSORRT_HEADERS:
        text = _read_text(root, rel)
        if text:
            found("tensorrt", parse_version_header(text, "NV_TENSORRT_"), "file:/" + rel)
    for rel in CUDNN_HEADERS:
        text = _read_text(root, rel)
        if text:
            found("cudnn", parse_version_header(text, "CUDNN_"), "file:/" + rel)
    dpkg: Dict[str, str] = {}
    try:
        with open(_path(root, DPKG_STATUS_FILE), "r", errors="replace") as f:
            dpkg = parse_dpkg_status(f)
    except OSError:
        pass
    for pkg in sorted(dpkg):
        version = upstream_version(dpkg[pkg])
        if pkg.startswith("libnvinfer") or pkg == "tensorrt":
            found("tensorrt", version, "dpkg:" + pkg)
        elif pkg.startswith("libcudnn"):
            found("cudnn", version, "dpkg:" + pkg)
        elif pkg.startswith("cuda-cudart"):
            found("cuda", version, "dpkg:" + pkg)
        elif pkg == "nvidia-l4t-core" and not info.l4t and _VERSION_RE.match(version):
            info.l4t = version
            info.versions_source["l4t"] = "dpkg:nvidia-l4t-core"
    if live:
        found("tensorrt", dist_version("tensorrt"), "python:tensorrt")
        info.onnxruntime = dist_version("onnxruntime") or dist_version("onnxruntime-gpu")


def _apply_release_table(info: PlatformInfo) -> None:
    if not info.l4t:
        return
    rel, exact = info.matrix.release(info.l4t)
    if rel is None:
        info.add_problem(
            "L4T {} is not in the support matrix's release table: JetPack, CUDA and TensorRT "
            "versions are unknown unless read from the device".format(info.l4t),
            "add it to jetpack_releases in agent/data/support_matrix.yaml")
        return
    if not info.jetpack:
        info.jetpack = rel["jetpack"]
        info.versions_source.setdefault("jetpack", "table:L4T " + rel["l4t"])
    if not exact:
        info.add_problem(
            "L4T {} is not in the release table; assumed JetPack {} (as L4T {})".format(
                info.l4t, rel["jetpack"], rel["l4t"]),
            "add L4T {} to jetpack_releases in agent/data/support_matrix.yaml".format(info.l4t))
    for what in ("cuda", "tensorrt", "cudnn"):
        if not getattr(info, what) and rel.get(what):
            setattr(info, what, rel[what])
            info.versions_source[what] = "table:JetPack " + rel["jetpack"]


def _check_dla(info: PlatformInfo) -> None:
    """DLA cores count only with a TensorRT that drives them on this board (the matrix's
    ``dla_tensorrt``): none from 10.8 to 11.4.0, and only AGX Orin from 11.4.1."""
    if not info.dla_cores or not info.tensorrt:
        return
    if info.matrix.dla_available(info.tensorrt, info.family):
        return
    info.add_problem(
        "{} DLA core(s) found, but TensorRT {} has no DLA for this board: builds use the "
        "GPU".format(info.dla_cores, info.tensorrt),
        "DLA needs TensorRT <= 10.7 (JetPack 5 / 6) or >= 11.4.1 on AGX Orin (JetPack >= "
        "7.2.2); see docs/tensorrt.md")
    info.dla_cores = 0
    info.dla_source = "tensorrt {}".format(info.tensorrt)


def dla_available(tensorrt: str, family: Optional[str], matrix: Optional[Any] = None) -> bool:
    """Whether TensorRT ``tensorrt`` drives the DLA of board family ``family``."""
    from agent.platform.matrix import load_matrix

    return (matrix or load_matrix()).dla_available(tensorrt, family)


def _check_tensorrt_cc(info: PlatformInfo) -> None:
    """TensorRT 10 dropped GPUs below CC 7.0 and 10.5 Volta (8.x: 5.0): say so instead of
    failing a build."""
    if not info.tensorrt or not info.compute_capability:
        return
    need = info.matrix.tensorrt_min_cc_for(info.tensorrt)
    if need and version_key(info.compute_capability) < version_key(need):
        info.add_problem(
            "TensorRT {} needs compute capability >= {}; this GPU has {}".format(
                info.tensorrt, need, info.compute_capability),
            "use the TensorRT release of this board's last JetPack ({})".format(
                (info.matrix_row.get("tensorrt") or {}).get("last", "see the support matrix")))


def _check_precision_types(info: PlatformInfo) -> None:
    """The matrix rates a board's precisions; the installed TensorRT must also have the type
    (bf16 on Orin needs TensorRT >= 9.0, not JetPack 6.0's 8.6.2). Those become ``none``, with
    the reason as the row's note, so ``decide`` and ``diag`` say it."""
    if info.backend != "tensorrt" or not info.tensorrt:
        return
    row = info.matrix_row
    for precision, level in list(row["precisions"].items()):
        why = info.matrix.tensorrt_lacks(precision, info.tensorrt)
        if why and level == "native":
            row["precisions"] = dict(row["precisions"], **{precision: "none"})
            row["precision_notes"] = dict(row.get("precision_notes") or {}, **{precision: why})
