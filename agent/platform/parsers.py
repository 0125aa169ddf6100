"""Where detection reads and the pure parsers of what it finds there: device-tree strings,
``/etc/nv_tegra_release``, ``/proc/meminfo``, dpkg's status file, CUDA/TensorRT/cuDNN version
files and headers, ``nvidia-smi`` output. No I/O here: the caller reads, these functions parse
and raise AgentError("bad_platform_data") naming the file for garbled input.
"""

import itertools
import json
import re
from typing import Any, Dict, List, Optional

from agent.errors import AgentError

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

_VERSION_RE = re.compile(r"^\d+(\.\d+)*$")


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
