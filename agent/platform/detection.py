"""``detect(root)``: what this machine is. A Jetson (device tree, release file, devfreq), a
discrete NVIDIA GPU (nvidia-smi, /proc/driver/nvidia) or a CPU host; plus the cheap
``looks_like_jetson()`` check telemetry uses."""

import glob
import os
import platform as _std_platform
import re
import shutil
import subprocess
from typing import Any, Dict, List, Optional, Tuple

from agent.errors import AgentError
from agent.platform.info import PlatformInfo
from agent.platform.jtop import JtopFactory, _apply_jtop, _close_quietly, connect_jtop
from agent.platform.matrix import Matrix, load_matrix
from agent.platform.parsers import (
    COMPATIBLE_FILE,
    CPUINFO_FILE,
    MEMINFO_FILE,
    MODEL_FILE,
    NVIDIA_GPUS_GLOB,
    RELEASE_FILE,
    parse_compatible,
    parse_meminfo_kb,
    parse_model,
    parse_nvidia_information,
    parse_nvidia_smi,
    parse_tegra_release,
)
from agent.platform.tree import (
    _count_dla,
    _gpu_devfreq_nodes,
    _match_family,
    _module_by_memory,
    _path,
    _read_optional,
    _read_text,
    _soc_from_compatible,
    _soc_from_devfreq,
)
from agent.platform.versions import (
    _apply_release_table,
    _check_dla,
    _check_precision_types,
    _check_tensorrt_cc,
    _detect_versions,
)


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


def memory_for_builds(root: str = "/") -> Tuple[int, bool]:
    """(this machine's RAM in bytes, whether its GPU shares it): a build's memory cap
    (``builder.memory_limit``) defaults to a share of it on a Jetson."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        total = 0
    return int(total), looks_like_jetson(root)


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
    _check_precision_types(info)
    _check_dla(info)
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
