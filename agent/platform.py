"""What this machine is and which precisions it runs: board detection, the support matrix and the
precision decision.

``detect(root)`` reads the device tree, ``/etc/nv_tegra_release``, devfreq nodes, CUDA/TensorRT/
cuDNN version files and dpkg's status file, all relative to ``root`` so tests can feed recorded
trees; it asks the jtop service for board info when it is reachable and notes a problem (with
the fix) when it is not. ``load_matrix()`` validates ``agent/data/support_matrix.yaml``.
``decide(request, info)`` is pure: it picks a precision from the matrix row or rejects.

Imports stay light (no onnxruntime/tensorrt/jtop at import time): ``diag`` and the idle daemon
load this module. Written to also run on Python 3.6 so a JetPack 4.6 worker can import it.
"""

import glob
import itertools
import json
import os
import platform as _std_platform
import re
import shutil
import subprocess
import threading
from collections import OrderedDict
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Tuple, Union

import yaml

from agent.errors import AgentError

# Canonical order, widest to narrowest.
PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "int8", "fp8", "fp4")
LEVELS = ("native", "emulated", "none")
FALLBACK_POLICIES = ("allow", "reject")
# Where a precision falls back to when the board lacks it: towards wider, safer formats.
# bf16 goes to fp32, not fp16: bf16 is chosen for its range, which fp16 does not have.
FALLBACK_CHAINS = {
    "fp4": ("fp8", "fp16", "fp32"),
    "fp8": ("fp16", "fp32"),
    "int8": ("fp16", "fp32"),
    "fp16": ("fp32",),
    "bf16": ("fp32",),
    "tf32": ("fp32",),
    "fp32": (),
}
# "best" mirrors TensorRT's --best: the fastest of these the board runs.
BEST_ORDER = ("int8", "fp16", "fp32")

DEFAULT_MATRIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                              "support_matrix.yaml")

# Files detection reads, relative to the root.
MODEL_FILE = "proc/device-tree/model"
COMPATIBLE_FILE = "proc/device-tree/compatible"
RELEASE_FILE = "etc/nv_tegra_release"
MEMINFO_FILE = "proc/meminfo"
CPUINFO_FILE = "proc/cpuinfo"
DPKG_STATUS_FILE = "var/lib/dpkg/status"
DEVFREQ_DIR = "sys/class/devfreq"
NVIDIA_GPUS_GLOB = "proc/driver/nvidia/gpus/*/information"
NVIDIA_VERSION_FILE = "proc/driver/nvidia/version"
CUDA_VERSION_FILES = ("usr/local/cuda/version.json", "usr/local/cuda/version.txt")
TENSORRT_HEADERS = ("usr/include/aarch64-linux-gnu/NvInferVersion.h",
                    "usr/include/x86_64-linux-gnu/NvInferVersion.h",
                    "usr/include/NvInferVersion.h")
CUDNN_HEADERS = ("usr/include/cudnn_version.h",
                 "usr/include/aarch64-linux-gnu/cudnn_version.h",
                 "usr/include/x86_64-linux-gnu/cudnn_version.h")
DLA_GLOBS = ("sys/devices/platform/host1x/*.nvdla*",
             "sys/devices/platform/*.host1x/*.nvdla*",
             "sys/devices/platform/bus@0/*.host1x/*.nvdla*")
JTOP_SOCKET = "/run/jtop.sock"
JTOP_TIMEOUT_S = 4.0

FIX_JTOP_SERVICE = "sudo systemctl enable --now jtop"
FIX_JTOP_GROUP = "sudo usermod -aG jtop $USER, then log out and back in"
FIX_JTOP_INSTALL = "sudo pip3 install -U jetson-stats, then sudo systemctl enable --now jtop"

Problem = Dict[str, str]


def problem(text: str, fix: str) -> Problem:
    return {"problem": text, "fix": fix}


# --------------------------------------------------------------------------- the matrix

class Matrix(object):
    """The validated support matrix. ``families`` keeps the file's order."""

    def __init__(self, path: str, data: Dict[str, Any]) -> None:
        self.path = path
        self.socs: Dict[str, Dict[str, Any]] = data["socs"]
        self.families: Dict[str, Dict[str, Any]] = OrderedDict(data["families"])
        self.cc_rules: Dict[str, Dict[str, Any]] = data["cc_rules"]
        self.tensorrt_min_cc: Dict[str, str] = data["tensorrt_min_cc"]
        self.host: Dict[str, Any] = data["host"]
        self.releases: List[Dict[str, str]] = data["jetpack_releases"]

    def family_row(self, family_id: str) -> Dict[str, Any]:
        fam = self.families[family_id]
        soc = self.socs[fam["soc"]]
        return {
            "id": family_id,
            "name": fam["name"],
            "source": "family",
            "soc": fam["soc"],
            "gpu_arch": soc["gpu_arch"],
            "compute_capability": soc["compute_capability"],
            "backend": "tensorrt",
            "precisions": dict(fam["precisions"]),
            "precision_notes": dict(fam.get("precision_notes") or {}),
            "dla_cores": fam["dla_cores"],
            "jetpack": dict(fam["jetpack"]),
            "tensorrt": dict(fam["tensorrt"]),
            "python": dict(fam["python"]),
            "notes": list(fam.get("notes") or []),
        }

    def host_row(self) -> Dict[str, Any]:
        return {
            "id": "host",
            "name": self.host["name"],
            "source": "host",
            "soc": None,
            "gpu_arch": None,
            "compute_capability": None,
            "backend": self.host["backend"],
            "precisions": dict(self.host["precisions"]),
            "precision_notes": {},
            "dla_cores": 0,
            "jetpack": None,
            "tensorrt": None,
            "python": None,
            "notes": list(self.host.get("notes") or []),
        }

    def cc_precisions(self, cc: Optional[str]) -> Dict[str, str]:
        """Precision levels by the compute-capability rules (fp32 only when CC is unknown)."""
        out = {}
        for prec in PRECISIONS:
            if cc is None:
                out[prec] = "native" if prec == "fp32" else "none"
                continue
            rule = self.cc_rules[prec]
            ok = cc in rule.get("also", []) or version_key(cc) >= version_key(rule["min"])
            out[prec] = "native" if ok else "none"
        return out

    def cc_row(self, cc: Optional[str], name: str, soc: Optional[str] = None,
               gpu_arch: Optional[str] = None) -> Dict[str, Any]:
        return {
            "id": "cc-" + cc if cc else "cc-unknown",
            "name": name,
            "source": "cc_rules",
            "soc": soc,
            "gpu_arch": gpu_arch,
            "compute_capability": cc,
            "backend": "tensorrt",
            "precisions": self.cc_precisions(cc),
            "precision_notes": {} if cc else {
                p: "compute capability unknown: only fp32 is assumed" for p in PRECISIONS[1:]},
            "dla_cores": 0,
            "jetpack": None,
            "tensorrt": None,
            "python": None,
            "notes": ["classified by the compute-capability rules of the support matrix"],
        }

    def release(self, l4t: str) -> Tuple[Optional[Dict[str, str]], bool]:
        """The jetpack_releases entry for an L4T version: (entry, exact). Falls back to the
        newest known release of the same major.minor line that is not newer."""
        for rel in self.releases:
            if rel["l4t"] == l4t:
                return rel, True
        key = version_key(l4t)
        same_line = [r for r in self.releases
                     if version_key(r["l4t"])[:2] == key[:2] and version_key(r["l4t"]) <= key]
        if same_line:
            return max(same_line, key=lambda r: version_key(r["l4t"])), False
        return None, False


_VERSION_RE = re.compile(r"^\d+(\.\d+)*$")
_PART_RE = re.compile(r"^p\d{4}-\d{4}$")

_FAMILY_KEYS = {"name", "soc", "match", "modules", "precisions", "precision_notes", "dla_cores",
                "jetpack", "tensorrt", "python", "notes"}
_FAMILY_REQUIRED = _FAMILY_KEYS - {"precision_notes", "notes"}
_TOP_KEYS = {"schema", "socs", "families", "cc_rules", "tensorrt_min_cc", "host",
             "jetpack_releases"}


class _Checker(object):
    """Small schema checks that name the file, the place and what was expected."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, where: str, expected: str, found: Any) -> None:
        raise AgentError(
            "bad_platform_data",
            "{}: {}: expected {}, found {!r}".format(self.path, where, expected, found),
            {"file": self.path, "where": where},
        )

    def mapping(self, where: str, value: Any, required: Sequence[str] = (),
                allowed: Optional[Collection[str]] = None) -> Dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(where, "a mapping", value)
        if allowed is not None:
            for key in value:
                if key not in allowed:
                    self.fail(where, "keys among {}".format(", ".join(sorted(allowed))),
                              key)
        for key in required:
            if key not in value:
                self.fail(where, "a key {!r}".format(key), sorted(value))
        return value

    def string(self, where: str, value: Any) -> str:
        if not isinstance(value, str) or not value:
            self.fail(where, "a non-empty string", value)
        return value

    def version(self, where: str, value: Any) -> str:
        if not isinstance(value, str) or not _VERSION_RE.match(value):
            self.fail(where, 'a quoted version string like "8.7"', value)
        return value

    def strings(self, where: str, value: Any) -> List[str]:
        if not isinstance(value, list):
            self.fail(where, "a list of strings", value)
        for i, item in enumerate(value):
            self.string("{}[{}]".format(where, i), item)
        return value

    def levels(self, where: str, value: Any) -> Dict[str, str]:
        self.mapping(where, value, required=PRECISIONS, allowed=PRECISIONS)
        for prec, level in value.items():
            if level not in LEVELS:
                self.fail("{}.{}".format(where, prec), "one of " + ", ".join(LEVELS), level)
        return value

    def version_range(self, where: str, value: Any) -> None:
        self.mapping(where, value, required=("last",), allowed=("first", "last"))
        for key, item in value.items():
            self.version("{}.{}".format(where, key), item)


def _validate(path: str, data: Any) -> Dict[str, Any]:
    c = _Checker(path)
    c.mapping("top level", data, required=sorted(_TOP_KEYS), allowed=_TOP_KEYS)
    if data["schema"] != 1:
        c.fail("schema", "1", data["schema"])
    for soc, info in c.mapping("socs", data["socs"]).items():
        where = "socs." + str(soc)
        c.mapping(where, info, required=("gpu_arch", "compute_capability", "gpu_devfreq"),
                  allowed=("gpu_arch", "compute_capability", "gpu_devfreq"))
        c.string(where + ".gpu_arch", info["gpu_arch"])
        c.version(where + ".compute_capability", info["compute_capability"])
        c.strings(where + ".gpu_devfreq", info["gpu_devfreq"])
    for fid, fam in c.mapping("families", data["families"]).items():
        where = "families." + str(fid)
        c.mapping(where, fam, required=sorted(_FAMILY_REQUIRED), allowed=_FAMILY_KEYS)
        c.string(where + ".name", fam["name"])
        if fam["soc"] not in data["socs"]:
            c.fail(where + ".soc", "a SoC listed under socs ({})".format(
                ", ".join(data["socs"])), fam["soc"])
        match = c.mapping(where + ".match", fam["match"], required=("compatible", "model"),
                          allowed=("compatible", "model"))
        c.strings(where + ".match.compatible", match["compatible"])
        c.strings(where + ".match.model", match["model"])
        if not isinstance(fam["modules"], list):
            c.fail(where + ".modules", "a list", fam["modules"])
        for i, mod in enumerate(fam["modules"]):
            mwhere = "{}.modules[{}]".format(where, i)
            c.mapping(mwhere, mod, required=("part", "name"),
                      allowed=("part", "name", "memory_gb", "dla_cores"))
            if not isinstance(mod["part"], str) or not _PART_RE.match(mod["part"]):
                c.fail(mwhere + ".part", "a part number like p3767-0000", mod["part"])
            for key in ("memory_gb", "dla_cores"):
                if key in mod and (not isinstance(mod[key], int) or mod[key] < 0):
                    c.fail(mwhere + "." + key, "a non-negative integer", mod[key])
        c.levels(where + ".precisions", fam["precisions"])
        for prec, note in (fam.get("precision_notes") or {}).items():
            if prec not in PRECISIONS:
                c.fail(where + ".precision_notes", "precision names among " +
                       ", ".join(PRECISIONS), prec)
            c.string("{}.precision_notes.{}".format(where, prec), note)
        if not isinstance(fam["dla_cores"], int) or fam["dla_cores"] < 0:
            c.fail(where + ".dla_cores", "a non-negative integer", fam["dla_cores"])
        for key in ("jetpack", "tensorrt", "python"):
            c.version_range("{}.{}".format(where, key), fam[key])
        c.strings(where + ".notes", fam.get("notes") or [])
    rules = c.mapping("cc_rules", data["cc_rules"], required=PRECISIONS, allowed=PRECISIONS)
    for prec, rule in rules.items():
        where = "cc_rules." + prec
        c.mapping(where, rule, required=("min",), allowed=("min", "also"))
        c.version(where + ".min", rule["min"])
        for i, cc in enumerate(rule.get("also", [])):
            c.version("{}.also[{}]".format(where, i), cc)
    for major, cc in c.mapping("tensorrt_min_cc", data["tensorrt_min_cc"]).items():
        c.version("tensorrt_min_cc key", major)
        c.version("tensorrt_min_cc." + str(major), cc)
    host = c.mapping("host", data["host"], required=("name", "backend", "precisions"),
                     allowed=("name", "backend", "precisions", "notes"))
    c.string("host.name", host["name"])
    if host["backend"] != "onnxruntime":
        c.fail("host.backend", "'onnxruntime'", host["backend"])
    c.levels("host.precisions", host["precisions"])
    if not isinstance(data["jetpack_releases"], list):
        c.fail("jetpack_releases", "a list", data["jetpack_releases"])
    rel_keys = ("l4t", "jetpack", "cuda", "tensorrt", "cudnn", "python")
    for i, rel in enumerate(data["jetpack_releases"]):
        where = "jetpack_releases[{}]".format(i)
        c.mapping(where, rel, required=("l4t", "jetpack"), allowed=rel_keys)
        for key, value in rel.items():
            c.version("{}.{}".format(where, key), value)
    return data


_MATRIX_CACHE: Dict[str, Matrix] = {}


def load_matrix(path: Optional[str] = None) -> Matrix:
    """Load and validate the support matrix (the packaged one by default; cached per path)."""
    path = os.path.abspath(path or DEFAULT_MATRIX)
    if path in _MATRIX_CACHE:
        return _MATRIX_CACHE[path]
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise AgentError("bad_platform_data", "{}: cannot read the support matrix: {}".format(
            path, exc.strerror or exc), {"file": path})
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise AgentError("bad_platform_data", "{}: expected YAML, found a syntax error: {}".format(
            path, str(exc).replace("\n", " ")), {"file": path})
    matrix = Matrix(path, _validate(path, data))
    _MATRIX_CACHE[path] = matrix
    return matrix


# --------------------------------------------------------------------------- pure parsers

def version_key(version: str) -> Tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


_RELEASE_RE = re.compile(r"^# R(\d+) \(release\), REVISION: (\d+)\.(\d+)")


def parse_tegra_release(text: str, path: str = RELEASE_FILE) -> str:
    """``# R32 (release), REVISION: 7.1, GCID: ...`` -> ``32.7.1``."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    m = _RELEASE_RE.match(first)
    if not m:
        raise AgentError(
            "bad_platform_data",
            "{}: expected a first line like '# R36 (release), REVISION: 4.3, GCID: ...', "
            "found {!r}".format(path, first[:80]), {"file": path})
    return "{}.{}.{}".format(*m.groups())


def _printable(text: str) -> bool:
    return all(32 <= ord(ch) < 127 for ch in text)


def parse_compatible(raw: bytes, path: str = COMPATIBLE_FILE) -> List[str]:
    """NUL-separated ASCII strings (``nvidia,p3450-0000\\0nvidia,tegra210\\0``)."""
    try:
        entries = [e for e in raw.decode("ascii").split("\0")]
    except UnicodeDecodeError:
        entries = None
    if entries is not None:
        while entries and entries[-1] == "":
            entries.pop()
    if not entries or any(not e or not _printable(e) for e in entries):
        raise AgentError(
            "bad_platform_data",
            "{}: expected NUL-separated ASCII strings like "
            "'nvidia,p3450-0000\\0nvidia,tegra210\\0', found {!r}".format(path, raw[:60]),
            {"file": path})
    return entries


def parse_model(raw: bytes, path: str = MODEL_FILE) -> str:
    """A NUL-terminated ASCII string (``NVIDIA Jetson Nano Developer Kit\\0``)."""
    try:
        text = raw.decode("ascii").rstrip("\0").strip()
    except UnicodeDecodeError:
        text = None
    if not text or not _printable(text):
        raise AgentError(
            "bad_platform_data",
            "{}: expected a NUL-terminated ASCII board name like "
            "'NVIDIA Jetson Nano Developer Kit\\0', found {!r}".format(path, raw[:60]),
            {"file": path})
    return text


def parse_meminfo_kb(text: str, field: str = "MemTotal") -> Optional[int]:
    for line in text.splitlines():
        if line.startswith(field + ":"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1])
    return None


_DPKG_PACKAGES = re.compile(
    r"^(libnvinfer\d+|tensorrt|libcudnn\d+(-cuda-\d+)?|cuda-cudart-\d+-\d+|nvidia-l4t-core)$")


def parse_dpkg_status(lines: Any) -> Dict[str, str]:
    """Installed versions of the packages detection cares about, from dpkg's status file
    (an iterable of lines; streaming, the real file is several MB)."""
    out: Dict[str, str] = {}
    name: Optional[str] = None
    version: Optional[str] = None
    status: Optional[str] = None
    for line in itertools.chain(lines, [""]):
        line = line.rstrip("\n")
        if not line:
            if name and version and status and status.endswith(" installed"):
                out[name] = version
            name = version = status = None
        elif line.startswith("Package: "):
            pkg = line[9:].strip()
            name = pkg if _DPKG_PACKAGES.match(pkg) else None
        elif name and line.startswith("Status: "):
            status = line[8:].strip()
        elif name and line.startswith("Version: "):
            version = line[9:].strip()
    return out


def upstream_version(deb_version: str) -> str:
    """``8.2.1-1+cuda10.2`` -> ``8.2.1``; ``1:2.3-4`` -> ``2.3``."""
    version = deb_version.split(":", 1)[-1]
    return version.split("-", 1)[0].split("+", 1)[0]


def parse_version_header(text: str, prefix: str) -> Optional[str]:
    """MAJOR.MINOR.PATCH[.BUILD] from ``#define <prefix>MAJOR 8`` lines, following one level of
    indirection (TensorRT 10 defines ``NV_TENSORRT_MAJOR TRT_MAJOR_ENTERPRISE``)."""
    defines = dict(re.findall(r"^\s*#\s*define\s+(\w+)\s+(\w+)", text, re.M))
    parts: List[str] = []
    for field in ("MAJOR", "MINOR", "PATCH", "BUILD"):
        value = defines.get(prefix + field)
        if value is not None and not value.isdigit():
            value = defines.get(value)
        if value is None or not value.isdigit():
            if field == "BUILD" and len(parts) == 3:
                break
            return None
        parts.append(value)
    return ".".join(parts)


def parse_cuda_version_file(name: str, text: str) -> Optional[str]:
    if name.endswith(".json"):
        try:
            data = json.loads(text)
            version = data["cuda"]["version"]
        except (ValueError, KeyError, TypeError):
            return None
        return version if isinstance(version, str) and _VERSION_RE.match(version) else None
    m = re.search(r"CUDA Version (\d+(\.\d+)+)", text)
    return m.group(1) if m else None


def parse_nvidia_smi(text: str) -> List[Dict[str, Any]]:
    """``nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total
    --format=csv,noheader,nounits`` lines (compute_cap may be missing on old drivers)."""
    gpus = []
    for line in text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if not cells or not cells[0]:
            continue
        gpu: Dict[str, Any] = {"name": cells[0], "compute_capability": None, "driver": None,
                               "memory_total_mb": None}
        rest = cells[1:]
        if len(rest) == 3:
            cc = rest.pop(0)
            gpu["compute_capability"] = cc if _VERSION_RE.match(cc) else None
        if rest:
            gpu["driver"] = rest[0] or None
        if len(rest) > 1 and rest[1].isdigit():
            gpu["memory_total_mb"] = int(rest[1])
        gpus.append(gpu)
    return gpus


def parse_nvidia_information(text: str) -> Optional[str]:
    """``Model: NVIDIA GeForce RTX 3090`` from /proc/driver/nvidia/gpus/*/information."""
    m = re.search(r"^Model:\s*(.+)$", text, re.M)
    return m.group(1).strip() if m else None


# --------------------------------------------------------------------------- the result

class PlatformInfo(object):
    """What ``detect()`` found. Attributes are stable; ``to_dict()`` is documented in
    docs/platform.md."""

    def __init__(self, matrix: Matrix, root: str = "/") -> None:
        self.matrix = matrix
        self.root = root
        self.kind = "host"  # "jetson" | "dgpu" | "host"
        self.board = ""  # human-readable: device-tree model, GPU name or CPU name
        self.model: Optional[str] = None
        self.compatible: List[str] = []
        self.family: Optional[str] = None
        self.module: Optional[str] = None
        self.part_number: Optional[str] = None
        self.soc: Optional[str] = None
        self.gpu_arch: Optional[str] = None
        self.compute_capability: Optional[str] = None
        self.l4t: Optional[str] = None
        self.jetpack: Optional[str] = None
        self.cuda: Optional[str] = None
        self.tensorrt: Optional[str] = None
        self.cudnn: Optional[str] = None
        self.onnxruntime: Optional[str] = None
        self.versions_source: Dict[str, str] = {}
        self.dla_cores = 0
        self.dla_source = "table"
        self.memory_total_mb: Optional[int] = None
        self.gpus: List[Dict[str, Any]] = []
        self.backend = "onnxruntime"
        self.matrix_row: Dict[str, Any] = matrix.host_row()
        self.problems: List[Problem] = []
        self.jtop_used = False
        self.machine = _std_platform.machine()
        self.python = _std_platform.python_version()

    def level(self, precision: str) -> str:
        """native | emulated | none for one precision on this platform's row."""
        return self.matrix_row["precisions"].get(precision, "none")

    @property
    def supported_precisions(self) -> List[str]:
        return [p for p in PRECISIONS if self.level(p) != "none"]

    @property
    def emulated_precisions(self) -> List[str]:
        return [p for p in PRECISIONS if self.level(p) == "emulated"]

    def add_problem(self, problem: str, fix: str) -> None:
        entry = {"problem": problem, "fix": fix}
        if entry not in self.problems:
            self.problems.append(entry)

    def describe(self) -> str:
        """``Jetson TX2 (row tx2, tegra186, CC 6.2)`` for messages."""
        bits = ["row " + self.matrix_row["id"]]
        if self.soc:
            bits.append(self.soc)
        if self.compute_capability:
            bits.append("CC " + self.compute_capability)
        return "{} ({})".format(self.board or self.matrix_row["name"], ", ".join(bits))

    def fingerprint(self, backend: Optional[str] = None) -> Dict[str, str]:
        """What an engine or cache entry built here depends on; all values are strings ("" when
        unknown). Keys: kind, soc, gpu, compute_capability, cuda, tensorrt, cudnn, backend,
        backend_version."""
        backend = backend or self.backend
        gpu = self.gpus[0]["name"] if self.gpus else (self.gpu_arch or "")
        if self.kind == "host":
            gpu = "cpu:" + self.machine
        backend_version = self.tensorrt if backend == "tensorrt" else self.onnxruntime
        return {
            "kind": self.kind,
            "soc": self.soc or "",
            "gpu": gpu or "",
            "compute_capability": self.compute_capability or "",
            "cuda": self.cuda or "",
            "tensorrt": self.tensorrt or "",
            "cudnn": self.cudnn or "",
            "backend": backend,
            "backend_version": backend_version or "",
        }

    def to_dict(self) -> Dict[str, Any]:
        return {
            "kind": self.kind,
            "board": self.board,
            "model": self.model,
            "compatible": list(self.compatible),
            "family": self.family,
            "module": self.module,
            "part_number": self.part_number,
            "soc": self.soc,
            "gpu_arch": self.gpu_arch,
            "compute_capability": self.compute_capability,
            "l4t": self.l4t,
            "jetpack": self.jetpack,
            "cuda": self.cuda,
            "tensorrt": self.tensorrt,
            "cudnn": self.cudnn,
            "onnxruntime": self.onnxruntime,
            "versions_source": dict(self.versions_source),
            "dla_cores": self.dla_cores,
            "dla_source": self.dla_source,
            "memory_total_mb": self.memory_total_mb,
            "gpus": [dict(g) for g in self.gpus],
            "backend": self.backend,
            "matrix_row": dict(self.matrix_row),
            "precisions": {p: self.level(p) for p in PRECISIONS},
            "supported_precisions": self.supported_precisions,
            "emulated_precisions": self.emulated_precisions,
            "fingerprint": self.fingerprint(),
            "jtop_used": self.jtop_used,
            "machine": self.machine,
            "python": self.python,
            "root": self.root,
            "problems": [dict(p) for p in self.problems],
        }


# --------------------------------------------------------------------------- reading the tree

def _path(root: str, rel: str) -> str:
    return os.path.join(root, rel)


def _read_optional(root: str, rel: str) -> Optional[bytes]:
    """The file's bytes, None when it does not exist; AgentError when it exists but cannot be
    read (permissions, a directory in its place, I/O error)."""
    path = _path(root, rel)
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise AgentError(
            "bad_platform_data", "{}: expected a readable file, found: {}".format(
                path, exc.strerror or exc), {"file": path})


def _read_text(root: str, rel: str) -> Optional[str]:
    """Best-effort text for optional sources (version files, sysfs): None on any problem."""
    try:
        with open(_path(root, rel), "r", errors="replace") as f:
            return f.read()
    except (OSError, ValueError):
        return None


def _gpu_devfreq_nodes(root: str) -> List[str]:
    try:
        return sorted(os.listdir(_path(root, DEVFREQ_DIR)))
    except OSError:
        return []


def looks_like_jetson(root: str = "/") -> bool:
    """Cheap check used by telemetry: a tegra device tree, a release file or a Jetson GPU node."""
    raw = _read_text(root, COMPATIBLE_FILE) or ""
    if "nvidia,tegra" in raw:
        return True
    if os.path.isfile(_path(root, RELEASE_FILE)):
        return True
    try:
        matrix = load_matrix()
    except AgentError:
        return False
    return _soc_from_devfreq(matrix, _gpu_devfreq_nodes(root)) is not None


def _soc_from_compatible(compatible: List[str]) -> Optional[str]:
    for entry in compatible:
        m = re.match(r"^nvidia,(tegra\d+)$", entry)
        if m:
            return m.group(1)
    return None


def _parts_from_compatible(compatible: List[str]) -> List[str]:
    parts: List[str] = []
    for entry in compatible:
        for part in re.findall(r"p\d{4}-\d{4}", entry):
            if part not in parts:
                parts.append(part)
    return parts


def _match_family(matrix: Matrix, compatible: List[str], model: Optional[str],
                  soc: Optional[str], extra_parts: Sequence[str] = ()
                  ) -> Tuple[Optional[str], Optional[Dict[str, Any]], str]:
    """(family id, module entry, how) by module part number, then carrier/dev-kit compatible
    entries, then model-name substrings. Families on another SoC never match."""
    parts = list(extra_parts) + _parts_from_compatible(compatible)
    candidates = [(fid, fam) for fid, fam in matrix.families.items()
                  if soc is None or fam["soc"] == soc]
    for part in parts:
        for fid, fam in candidates:
            for mod in fam["modules"]:
                if mod["part"] == part:
                    return fid, mod, "module part number " + part
    for fid, fam in candidates:
        for entry in fam["match"]["compatible"]:
            if entry in compatible:
                return fid, None, "compatible entry " + entry
    if model:
        low = model.lower()
        # Longest keyword first so "Orin Nano" wins over a shorter, looser one.
        keyed = [(len(k), fid, k) for fid, fam in candidates for k in fam["match"]["model"]]
        for _, fid, keyword in sorted(keyed, reverse=True):
            if keyword.lower() in low:
                return fid, None, "model name contains " + repr(keyword)
    return None, None, ""


def _module_by_memory(fam: Dict[str, Any], memory_mb: Optional[int]) -> Optional[Dict[str, Any]]:
    """When no part number says which module it is, the one whose memory is closest, but only
    when the family's modules differ in something that matters (DLA cores)."""
    mods = [m for m in fam["modules"] if "memory_gb" in m]
    if not memory_mb or not mods or len({m.get("dla_cores") for m in mods}) < 2:
        return None
    return min(mods, key=lambda m: abs(m["memory_gb"] * 1024 - memory_mb))


def _soc_from_devfreq(matrix: Matrix, nodes: List[str]) -> Optional[str]:
    for soc, info in matrix.socs.items():
        if any(n in nodes for n in info["gpu_devfreq"]):
            return soc
    return None


def _count_dla(root: str) -> int:
    found = set()
    for pattern in DLA_GLOBS:
        for path in glob.glob(_path(root, pattern)):
            found.add(os.path.basename(path))
    return len(found)


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


# --------------------------------------------------------------------------- jtop

JtopFactory = Callable[[], Any]


def _default_jtop_factory(interval: float = 1.0) -> JtopFactory:
    from jtop import jtop  # noqa: PLC0415 - lazy: jetson-stats is only needed on devices

    return lambda: jtop(interval=interval)


def jtop_problem(exc: BaseException) -> Problem:
    """Map jtop's failure modes to one problem line with its fix."""
    text = str(exc)
    if isinstance(exc, ImportError):
        return problem("jetson-stats (jtop) is not installed", FIX_JTOP_INSTALL)
    if isinstance(exc, PermissionError) or "can't access" in text or "ermission" in text:
        return problem("user not in group jtop (cannot open {})".format(JTOP_SOCKET),
                       FIX_JTOP_GROUP)
    if "Mismatch" in text:
        return problem("jtop service and client versions differ: " + text.splitlines()[0],
                       "sudo pip3 install -U jetson-stats && sudo systemctl restart jtop")
    if isinstance(exc, TimeoutError):
        return problem("jtop service did not answer within {:.0f} s".format(JTOP_TIMEOUT_S),
                       "sudo systemctl restart jtop")
    if (isinstance(exc, (ConnectionRefusedError, FileNotFoundError)) or "not active" in text
            or "Lost connection" in text):
        return problem("jtop service not running", FIX_JTOP_SERVICE)
    return problem("jtop service unusable: {}".format(text.splitlines()[0] if text else
                                                       type(exc).__name__), FIX_JTOP_SERVICE)


def connect_jtop(factory: Optional[JtopFactory] = None, timeout: float = JTOP_TIMEOUT_S,
                 interval: float = 1.0) -> Tuple[Any, Optional[Problem]]:
    """Start a jtop client within ``timeout`` seconds: (client, None) or (None, problem).
    Never raises: every jtop failure becomes a problem line."""
    try:
        make = factory or _default_jtop_factory(interval)
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken jetson-stats install
        return None, jtop_problem(exc)
    box: Dict[str, Any] = {}
    gave_up = threading.Event()

    def run() -> None:
        try:
            client = make()
            client.start()
        except BaseException as exc:  # noqa: BLE001 - reported as a problem line
            box["error"] = exc
            return
        if gave_up.is_set():
            _close_quietly(client)
        else:
            box["client"] = client

    worker = threading.Thread(target=run, name="jtop-connect", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        gave_up.set()
        return None, jtop_problem(TimeoutError())
    if "error" in box:
        return None, jtop_problem(box["error"])
    return box["client"], None


def _close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing a broken client must not fail the caller
        pass


def jtop_dla_cores(client: Any) -> Optional[int]:
    """DLA cores from jtop's engine groups (``DLA0``, ``DLA1``), None when it has none."""
    try:
        engines = client.engine
    except Exception:  # noqa: BLE001 - older jtop versions have no engine property
        return None
    if not isinstance(engines, dict):
        return None
    count = sum(1 for name in engines if str(name).upper().startswith("DLA"))
    return count if count else None


def _apply_jtop(info: PlatformInfo, client: Any) -> None:
    """Use jtop's board info: the module from the EEPROM part number, run-time libraries."""
    try:
        board = client.board or {}
    except Exception as exc:  # noqa: BLE001 - a broken service is a problem line
        info.add_problem(**jtop_problem(exc))
        return
    info.jtop_used = True
    hw = board.get("hardware") or {}
    libs = board.get("libraries") or {}
    if hw.get("Module") and not info.module:
        info.module = str(hw["Module"])
    if hw.get("P-Number") and not info.part_number:
        info.part_number = str(hw["P-Number"])
    if hw.get("L4T") and not info.l4t and _VERSION_RE.match(str(hw["L4T"])):
        info.l4t = str(hw["L4T"])
        info.versions_source["l4t"] = "jtop"
    if hw.get("Jetpack") and not info.jetpack:
        info.jetpack = str(hw["Jetpack"]).split()[0]
        info.versions_source["jetpack"] = "jtop"
    for key, what in (("CUDA", "cuda"), ("TensorRT", "tensorrt"), ("cuDNN", "cudnn")):
        value = str(libs.get(key) or "")
        if _VERSION_RE.match(value):
            # Run-time versions win over files and tables.
            setattr(info, what, value)
            info.versions_source[what] = "jtop"
    cores = jtop_dla_cores(client)
    if cores is not None:
        info.dla_cores = cores
        info.dla_source = "jtop"


# --------------------------------------------------------------------------- detection

def detect(root: str = "/", use_jtop: bool = True, matrix: Optional[Matrix] = None,
           jtop_factory: Optional[JtopFactory] = None) -> PlatformInfo:
    """Detect the platform under ``root``. jtop is asked only for the live system (root "/")
    or when a ``jtop_factory`` is given; its absence is a problem line, never an error.
    Raises AgentError("bad_platform_data") naming the file for a corrupt device tree or an
    unreadable/garbled release file."""
    matrix = matrix or load_matrix()
    root = os.path.abspath(root)
    live = root == "/"
    info = PlatformInfo(matrix, root)

    raw_model = _read_optional(root, MODEL_FILE)
    raw_compat = _read_optional(root, COMPATIBLE_FILE)
    raw_release = _read_optional(root, RELEASE_FILE)
    if raw_model is not None:
        info.model = parse_model(raw_model, _path(root, MODEL_FILE))
    if raw_compat is not None:
        info.compatible = parse_compatible(raw_compat, _path(root, COMPATIBLE_FILE))
    if raw_release is not None:
        info.l4t = parse_tegra_release(raw_release.decode("ascii", "replace"),
                                       _path(root, RELEASE_FILE))
        info.versions_source["l4t"] = "file:/" + RELEASE_FILE
    meminfo = _read_text(root, MEMINFO_FILE)
    kb = parse_meminfo_kb(meminfo) if meminfo else None
    info.memory_total_mb = kb // 1024 if kb else None

    devfreq = _gpu_devfreq_nodes(root)
    soc = _soc_from_compatible(info.compatible) or _soc_from_devfreq(matrix, devfreq)
    is_jetson = bool(soc or raw_release is not None
                     or any(e.startswith("nvidia,tegra") for e in info.compatible))
    if is_jetson:
        _detect_jetson(info, root, soc, use_jtop and (live or jtop_factory is not None),
                       jtop_factory)
    else:
        _detect_gpu_or_host(info, root, live)
    _detect_versions(info, root, live)
    _apply_release_table(info)
    _check_tensorrt_cc(info)
    return info


def _detect_jetson(info: PlatformInfo, root: str, soc: Optional[str], ask_jtop: bool,
                   jtop_factory: Optional[JtopFactory]) -> None:
    matrix = info.matrix
    info.kind = "jetson"
    info.backend = "tensorrt"
    info.board = info.model or "NVIDIA Jetson (no device-tree model)"
    jtop_parts: List[str] = []
    client = None
    if ask_jtop:
        client, trouble = connect_jtop(jtop_factory)
        if trouble:
            info.add_problem(**trouble)
        else:
            try:
                hw = (client.board or {}).get("hardware") or {}
            except Exception:  # noqa: BLE001 - handled again in _apply_jtop
                hw = {}
            if hw.get("P-Number"):
                jtop_parts.append(str(hw["P-Number"]))
            if not soc and hw.get("SoC"):
                m = re.search(r"tegra\d+", str(hw["SoC"]))
                soc = m.group(0) if m else None
    family, module, how = _match_family(matrix, info.compatible, info.model, soc, jtop_parts)
    if family:
        fam = matrix.families[family]
        info.family = family
        info.matrix_row = matrix.family_row(family)
        info.soc = fam["soc"]
        module = module or _module_by_memory(fam, info.memory_total_mb)
        if module:
            info.module = module["name"]
            info.part_number = module["part"]
            info.dla_cores = module.get("dla_cores", fam["dla_cores"])
        else:
            info.dla_cores = fam["dla_cores"]
        info.matrix_row["matched_by"] = how
        if info.model and fam["match"]["model"] and \
                fam["match"]["model"][0].lower() not in info.model.lower():
            # Codenames such as "quill" or "Jetson-AGX" say little: add the family's name.
            info.board = "{} ({})".format(info.model, fam["name"])
    else:
        info.soc = soc
        soc_info = matrix.socs.get(soc or "")
        cc = soc_info["compute_capability"] if soc_info else None
        arch = soc_info["gpu_arch"] if soc_info else None
        where = "compatible: {}".format(", ".join(info.compatible) or "(none)")
        if cc:
            info.matrix_row = matrix.cc_row(cc, "unlisted Jetson board ({}, CC {})".format(
                soc, cc), soc, arch)
            info.add_problem(
                "board {!r} ({}) is not in the support matrix; classified by compute "
                "capability {} of {}".format(info.board, where, cc, soc),
                "add the board to families in agent/data/support_matrix.yaml")
        else:
            info.matrix_row = matrix.cc_row(None, "unknown Jetson board", soc)
            info.add_problem(
                "board {!r} ({}) has an unknown SoC {!r}: only fp32 is assumed".format(
                    info.board, where, soc),
                "add the SoC and the board to agent/data/support_matrix.yaml")
        info.dla_cores = 0
    soc_info = matrix.socs.get(info.soc or "")
    if soc_info:
        info.gpu_arch = soc_info["gpu_arch"]
        info.compute_capability = soc_info["compute_capability"]
    dla = _count_dla(root)
    if dla:
        info.dla_cores = dla
        info.dla_source = "sysfs"
    if client is not None:
        try:
            _apply_jtop(info, client)
        finally:
            _close_quietly(client)


def _run_nvidia_smi() -> Tuple[List[Dict[str, Any]], Optional[str]]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return [], None
    fields = ["name,compute_cap,driver_version,memory.total", "name,driver_version,memory.total"]
    error = None
    for query in fields:
        try:
            out = subprocess.run(  # noqa: UP022 - Python 3.6 has no capture_output
                [exe, "--query-gpu=" + query, "--format=csv,noheader,nounits"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=10,
                universal_newlines=True)  # noqa: UP021 - nor text=
        except (OSError, subprocess.SubprocessError) as exc:
            return [], "nvidia-smi failed: {}".format(exc)
        if out.returncode == 0:
            return parse_nvidia_smi(out.stdout), None
        error = (out.stderr or out.stdout).strip().splitlines()[:1]
    return [], "nvidia-smi failed: {}".format(error[0] if error else "no output")


def _detect_gpu_or_host(info: PlatformInfo, root: str, live: bool) -> None:
    matrix = info.matrix
    gpus: List[Dict[str, Any]] = []
    smi_error = None
    if live:
        gpus, smi_error = _run_nvidia_smi()
    if not gpus:
        for path in sorted(glob.glob(_path(root, NVIDIA_GPUS_GLOB))):
            try:
                with open(path, "r", errors="replace") as f:
                    name = parse_nvidia_information(f.read())
            except OSError:
                continue
            if name:
                gpus.append({"name": name, "compute_capability": None, "driver": None,
                             "memory_total_mb": None})
    if gpus:
        info.kind = "dgpu"
        info.backend = "tensorrt"
        info.gpus = gpus
        first = gpus[0]
        info.board = first["name"] + (" (+{} more)".format(len(gpus) - 1) if len(gpus) > 1
                                      else "")
        info.compute_capability = first["compute_capability"]
        if len({g["name"] for g in gpus}) > 1:
            info.add_problem("GPUs of different models: decisions use the first ({})".format(
                first["name"]), "pin the agent to one GPU model with CUDA_VISIBLE_DEVICES")
        if info.compute_capability:
            info.matrix_row = matrix.cc_row(info.compute_capability,
                                            "discrete GPU, compute capability {}".format(
                                                info.compute_capability))
        else:
            info.matrix_row = matrix.cc_row(None, "discrete GPU, compute capability unknown")
            info.add_problem(
                "compute capability of {} is unknown: only fp32 is assumed".format(first["name"]),
                "install an NVIDIA driver >= 510 so 'nvidia-smi --query-gpu=compute_cap' works")
        return
    if smi_error:
        info.add_problem(smi_error, "check the NVIDIA driver (nvidia-smi must run)")
    info.kind = "host"
    info.backend = "onnxruntime"
    info.matrix_row = matrix.host_row()
    cpuinfo = _read_text(root, CPUINFO_FILE) or ""
    m = re.search(r"^(model name|Model|Hardware)\s*:\s*(.+)$", cpuinfo, re.M)
    cpu = m.group(2).strip() if m else (_std_platform.processor() or info.machine)
    info.board = "CPU host: {}".format(cpu or "unknown CPU")


def _check_tensorrt_cc(info: PlatformInfo) -> None:
    """TensorRT 10 dropped GPUs below CC 7.0 (8.x: 5.0): say so instead of failing a build."""
    if not info.tensorrt or not info.compute_capability:
        return
    major = str(version_key(info.tensorrt)[0])
    need = info.matrix.tensorrt_min_cc.get(major)
    if need and version_key(info.compute_capability) < version_key(need):
        info.add_problem(
            "TensorRT {} needs compute capability >= {}; this GPU has {}".format(
                info.tensorrt, need, info.compute_capability),
            "use the TensorRT release of this board's last JetPack ({})".format(
                (info.matrix_row.get("tensorrt") or {}).get("last", "see the support matrix")))


def for_row(row_id: str, matrix: Optional[Matrix] = None) -> PlatformInfo:
    """A PlatformInfo for a matrix row without detection: ``"nano"``, ``"host"``, ``"cc-8.6"``.
    For planning on a controller (will this job run on that board?) and for tests."""
    matrix = matrix or load_matrix()
    info = PlatformInfo(matrix, root="")
    if row_id == "host":
        info.board = matrix.host["name"]
        return info
    if row_id.startswith("cc-"):
        cc = row_id[3:]
        if not _VERSION_RE.match(cc):
            raise AgentError("bad_argument",
                             "matrix row {!r}: expected cc-<major.minor>".format(row_id))
        info.kind = "dgpu"
        info.backend = "tensorrt"
        info.compute_capability = cc
        info.matrix_row = matrix.cc_row(cc, "compute capability " + cc)
        info.board = info.matrix_row["name"]
        return info
    if row_id not in matrix.families:
        raise AgentError("bad_argument", "unknown matrix row {!r}: expected one of {}".format(
            row_id, ", ".join(list(matrix.families) + ["host", "cc-<major.minor>"])))
    fam = matrix.families[row_id]
    info.kind = "jetson"
    info.backend = "tensorrt"
    info.family = row_id
    info.matrix_row = matrix.family_row(row_id)
    info.board = fam["name"]
    info.soc = fam["soc"]
    info.gpu_arch = matrix.socs[fam["soc"]]["gpu_arch"]
    info.compute_capability = matrix.socs[fam["soc"]]["compute_capability"]
    info.dla_cores = fam["dla_cores"]
    return info


# --------------------------------------------------------------------------- the decision

class Decision(object):
    """The outcome of ``decide()``. ``precision`` is the chosen concrete precision (None when
    rejected); ``plan_precision`` is what to put in BuildPlan.precision ("best" when the request
    was best and the board runs both int8 and fp16, as TensorRT's --best would)."""

    def __init__(self, status: str, precision: Optional[str], requested: Union[str, List[str]],
                 reason: str, emulated: bool, info: PlatformInfo, fallback: str,
                 plan_precision: Optional[str], supported: List[str]) -> None:
        self.status = status  # "accepted" | "fell_back" | "rejected"
        self.precision = precision
        self.requested = requested
        self.reason = reason
        self.emulated = emulated
        self.fallback = fallback
        self.plan_precision = plan_precision
        self.board = info.board
        self.row_id = info.matrix_row["id"]
        self.supported = supported

    @property
    def ok(self) -> bool:
        return self.status != "rejected"

    def to_dict(self) -> Dict[str, Any]:
        return {
            "status": self.status,
            "precision": self.precision,
            "plan_precision": self.plan_precision,
            "requested": self.requested,
            "reason": self.reason,
            "emulated": self.emulated,
            "fallback": self.fallback,
            "board": self.board,
            "matrix_row": self.row_id,
            "supported": list(self.supported),
        }

    def raise_if_rejected(self) -> "Decision":
        if self.status == "rejected":
            raise AgentError("unsupported_precision", self.reason, self.to_dict())
        return self


def _levels_for(info: PlatformInfo, backend: Optional[str]) -> Tuple[Dict[str, str], str]:
    if backend and backend != info.backend:
        if backend == "onnxruntime":
            return dict(info.matrix.host["precisions"]), "the onnxruntime backend"
        raise AgentError("bad_argument", "backend {!r} does not run on {} (its backend is "
                         "{!r})".format(backend, info.describe(), info.backend))
    return dict(info.matrix_row["precisions"]), info.describe()


def _why_not(info: PlatformInfo, precision: str) -> str:
    note = info.matrix_row.get("precision_notes", {}).get(precision)
    return " ({})".format(note) if note else ""


def decide(request: Union[str, Sequence[str]], info: PlatformInfo, fallback: str = "allow",
           backend: Optional[str] = None) -> Decision:
    """Pick a precision for ``request`` ("fp32", "fp16", "int8", "best", "tf32", "bf16", "fp8",
    "fp4", or a list in preference order) on ``info``'s matrix row. ``fallback="allow"`` walks
    down FALLBACK_CHAINS from the last preference; ``"reject"`` stops at the list. ``backend``
    ("onnxruntime") decides for another backend than the platform's own. Pure; never raises
    for an unsupported precision (see ``Decision.raise_if_rejected``)."""
    if fallback not in FALLBACK_POLICIES:
        raise AgentError("bad_argument", "fallback policy must be one of {}, found {!r}".format(
            ", ".join(FALLBACK_POLICIES), fallback))
    prefs = [request] if isinstance(request, str) else list(request)
    if not prefs:
        raise AgentError("bad_argument", "precision request is empty: expected one of {}".format(
            ", ".join(PRECISIONS + ("best",))))
    for p in prefs:
        if p not in PRECISIONS and p != "best":
            raise AgentError("bad_argument", "unknown precision {!r}: expected one of {}".format(
                p, ", ".join(PRECISIONS + ("best",))))
    levels, where = _levels_for(info, backend)
    supported = [p for p in PRECISIONS if levels.get(p, "none") != "none"]
    requested = request if isinstance(request, str) else list(prefs)

    def make(status: str, chosen: Optional[str], reason: str, plan: Optional[str] = None
             ) -> Decision:
        emulated = bool(chosen and levels.get(chosen) == "emulated")
        if chosen and emulated:
            reason += " (emulated by the onnxruntime backend: numerics, not speed)"
        return Decision(status, chosen, requested, reason, emulated, info, fallback,
                        plan or chosen, supported)

    tried: List[str] = []
    for i, pref in enumerate(prefs):
        status = "accepted" if i == 0 else "fell_back"
        missing = "; ".join("{} is not supported{}".format(t, _why_not(info, t)) for t in tried)
        if pref == "best":
            usable = [p for p in BEST_ORDER if levels.get(p, "none") != "none"]
            chosen = usable[0]
            plan = "best" if chosen == "int8" and "fp16" in usable else chosen
            reason = "best on {} is {} (the fastest of {} it runs)".format(
                where, chosen, ", ".join(usable))
            return make(status, chosen, (missing + "; " if missing else "") + reason, plan)
        if levels.get(pref, "none") != "none":
            reason = "{} runs on {}".format(pref, where)
            return make(status, pref, (missing + "; fell back to " + pref + ": " + reason)
                        if missing else reason)
        tried.append(pref)
    missing = "; ".join("{} is not supported{}".format(t, _why_not(info, t)) for t in tried)
    head = "{} on {}; it supports {}".format(missing, where, ", ".join(
        p + (" (emulated)" if levels[p] == "emulated" else "") for p in supported))
    if fallback == "reject":
        return make("rejected", None, head + "; fallback policy is 'reject'")
    for alt in FALLBACK_CHAINS[prefs[-1]]:
        if alt not in tried and levels.get(alt, "none") != "none":
            return make("fell_back", alt, "{}; fell back to {}".format(head, alt))
    return make("rejected", None, head + "; nothing to fall back to")

