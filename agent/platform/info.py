"""``PlatformInfo``, what detection found, and the problem lines (each with its fix) it carries."""

import platform as _std_platform
from typing import Any, Dict, List, Optional

from agent.platform.matrix import PRECISIONS, Matrix

Problem = Dict[str, str]
# The version of ``PlatformInfo.engine_class``: a fleet shares engines only between devices
# whose classes are equal, version included. 2: issue 24 (module, GPU, CC, DLA cores, CUDA);
# a daemon of an earlier release sends no class and is put in class version 1.
ENGINE_CLASS_VERSION = "2"


def problem(text: str, fix: str) -> Problem:
    return {"problem": text, "fix": fix}


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

    def engine_class(self, backend: Optional[str] = None) -> Dict[str, str]:
        """The fleet's sharing class of this device (``agent.fleet.transfer.sharing.device_class``):
        what decides whether one device's engine runs on another, as far as a status can say
        it: ``version`` (ENGINE_CLASS_VERSION: daemons of another release never share), the
        board and its module (the module fixes the GPU's SM count and the DLA cores on a
        Jetson: AGX Orin 32 GB has 14 SMs, 64 GB 16; Orin NX 8 GB one DLA, 16 GB two), GPU,
        compute capability, DLA cores, JetPack, CUDA, TensorRT and backend. The device still
        checks the exact engine key (SM count from CUDA included) before adopting."""
        fp = self.fingerprint(backend)
        return {
            "version": ENGINE_CLASS_VERSION,
            "board": self.board or "",
            "module": self.module or self.part_number or "",
            "gpu": fp["gpu"],
            "compute_capability": fp["compute_capability"],
            "dla_cores": fp["dla_cores"],
            "jetpack": self.jetpack or "",
            "cuda": fp["cuda"],
            "tensorrt": fp["tensorrt"],
            "backend": fp["backend"] or "",
        }

    def fingerprint(self, backend: Optional[str] = None) -> Dict[str, str]:
        """What an engine or cache entry built here depends on; all values are strings ("" when
        unknown). Keys: kind, soc, module, gpu, compute_capability, dla_cores, cuda, tensorrt,
        cudnn, backend, backend_version."""
        backend = backend or self.backend
        gpu = self.gpus[0]["name"] if self.gpus else (self.gpu_arch or "")
        if self.kind == "host":
            gpu = "cpu:" + self.machine
        backend_version = self.tensorrt if backend == "tensorrt" else self.onnxruntime
        return {
            "kind": self.kind,
            "soc": self.soc or "",
            "module": self.module or self.part_number or "",
            "gpu": gpu or "",
            "compute_capability": self.compute_capability or "",
            "dla_cores": str(self.dla_cores or 0),
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
