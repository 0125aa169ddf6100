"""What this machine is and which precisions it runs: board detection, the support matrix and the
precision decision.

``detect(root)`` reads the device tree, ``/etc/nv_tegra_release``, devfreq nodes, CUDA/TensorRT/
cuDNN version files and dpkg's status file, all relative to ``root`` so tests can feed recorded
trees; it asks the jtop service for board info when it is reachable and notes a problem (with
the fix) when it is not. ``load_matrix()`` validates ``agent/data/support_matrix.yaml``.
``decide(request, info)`` is pure: it picks a precision from the matrix row or rejects.

Modules: ``matrix`` (the support matrix, precision constants, fallback chains), ``parsers``
(pure parsers of the files detection reads), ``info`` (``PlatformInfo``, problem lines),
``jtop`` (the jtop service), ``tree`` (reading the tree under a root, board matching),
``versions`` (CUDA/TensorRT/cuDNN/JetPack versions), ``detection`` (``detect()``), ``decision``
(``decide()``, ``Decision``, ``for_row()``). They are not named after their functions so that
``agent.platform.detect`` stays the function. This package re-exports their public names:
callers use ``from agent import platform`` or ``from agent.platform import ...``.

Imports stay light (no onnxruntime/tensorrt/jtop at import time): ``diag`` and the idle daemon
load this package. Written to also run on Python 3.6 so a JetPack 4.6 worker can import it.

May import only the base modules (``errors``, ``fsio``, ``log``, ``progress``); everything else
may import it. tests/unit/test_import_rules.py enforces this.
"""

from agent.platform.decision import Decision, decide, for_row
from agent.platform.detection import detect, looks_like_jetson
from agent.platform.info import PlatformInfo, Problem, problem
from agent.platform.jtop import (
    FIX_JTOP_GROUP,
    FIX_JTOP_INSTALL,
    FIX_JTOP_SERVICE,
    JTOP_SOCKET,
    JTOP_TIMEOUT_S,
    JtopFactory,
    connect_jtop,
    jtop_dla_cores,
    jtop_problem,
)
from agent.platform.matrix import (
    BEST_ORDER,
    DEFAULT_MATRIX,
    FALLBACK_CHAINS,
    FALLBACK_POLICIES,
    LEVELS,
    PRECISIONS,
    Matrix,
    load_matrix,
)
from agent.platform.parsers import (
    COMPATIBLE_FILE,
    CPUINFO_FILE,
    CUDA_VERSION_FILES,
    CUDNN_HEADERS,
    DEVFREQ_DIR,
    DLA_GLOBS,
    DPKG_STATUS_FILE,
    MEMINFO_FILE,
    MODEL_FILE,
    NVIDIA_GPUS_GLOB,
    NVIDIA_VERSION_FILE,
    RELEASE_FILE,
    TENSORRT_HEADERS,
    parse_compatible,
    parse_cuda_version_file,
    parse_dpkg_status,
    parse_meminfo_kb,
    parse_model,
    parse_nvidia_information,
    parse_nvidia_smi,
    parse_tegra_release,
    parse_version_header,
    upstream_version,
)
from agent.platform.versions import dist_version, dla_available
from agent.version_key import version_key

# The public names of the former single-module agent/platform.py, unchanged.
__all__ = [
    # matrix
    "BEST_ORDER", "DEFAULT_MATRIX", "FALLBACK_CHAINS", "FALLBACK_POLICIES", "LEVELS",
    "PRECISIONS", "Matrix", "load_matrix", "dla_available",
    # parsers
    "COMPATIBLE_FILE", "CPUINFO_FILE", "CUDA_VERSION_FILES", "CUDNN_HEADERS", "DEVFREQ_DIR",
    "DLA_GLOBS", "DPKG_STATUS_FILE", "MEMINFO_FILE", "MODEL_FILE", "NVIDIA_GPUS_GLOB",
    "NVIDIA_VERSION_FILE", "RELEASE_FILE", "TENSORRT_HEADERS", "parse_compatible",
    "parse_cuda_version_file", "parse_dpkg_status", "parse_meminfo_kb", "parse_model",
    "parse_nvidia_information", "parse_nvidia_smi", "parse_tegra_release",
    "parse_version_header", "upstream_version", "version_key",
    # info
    "PlatformInfo", "Problem", "problem",
    # jtop
    "FIX_JTOP_GROUP", "FIX_JTOP_INSTALL", "FIX_JTOP_SERVICE", "JTOP_SOCKET", "JTOP_TIMEOUT_S",
    "JtopFactory", "connect_jtop", "jtop_dla_cores", "jtop_problem",
    # detection, versions
    "detect", "dist_version", "looks_like_jetson",
    # decision
    "Decision", "decide", "for_row",
]
