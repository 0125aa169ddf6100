"""The support matrix: which boards exist and which precisions each runs.

``load_matrix()`` reads and validates ``agent/data/support_matrix.yaml`` (schema errors name the
file, the place and what was expected); ``Matrix`` turns it into rows (a family, the host, or a
compute-capability classification). The precision constants and fallback chains live here too.
"""

import os
import re
from collections import OrderedDict
from typing import Any, Collection, Dict, List, Optional, Sequence, Tuple

import yaml

from agent.errors import AgentError
from agent.platform.parsers import _VERSION_RE
from agent.version_key import version_key

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

# The data file belongs to the agent package, not to this subpackage.
DEFAULT_MATRIX = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "data", "support_matrix.yaml")


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
        self.dla_tensorrt: List[Dict[str, Any]] = list(data.get("dla_tensorrt") or [])
        self.precision_tensorrt: Dict[str, str] = dict(data.get("precision_tensorrt") or {})

    def tensorrt_lacks(self, precision: str, tensorrt: Optional[str]) -> Optional[str]:
        """Why TensorRT ``tensorrt`` cannot build ``precision`` (its type came later), or None
        (it can, or the version is unknown)."""
        first = self.precision_tensorrt.get(precision)
        if not first or not tensorrt or version_key(tensorrt) >= version_key(first):
            return None
        return "TensorRT {} has no {} type; it needs TensorRT >= {}".format(
            tensorrt, precision, first)

    def tensorrt_min_cc_for(self, tensorrt: str) -> Optional[str]:
        """The oldest compute capability TensorRT ``tensorrt`` builds for: the
        ``tensorrt_min_cc`` entry with the greatest key at or below it (``10.5`` covers 10.5 -
        10.x, ``10`` covers 10.0 - 10.4), or None when no key is that old."""
        have = version_key(tensorrt)
        best: Optional[Tuple[int, ...]] = None
        need = None
        for key, cc in self.tensorrt_min_cc.items():
            k = version_key(key)
            if have[:len(k)] >= k and (best is None or k > best):
                best, need = k, cc
        return need

    def dla_available(self, tensorrt: str, family: Optional[str]) -> bool:
        """Whether TensorRT ``tensorrt`` can use the DLA cores of ``family`` (a matrix without
        ``dla_tensorrt`` says yes: the board's count decides)."""
        if not self.dla_tensorrt:
            return True
        have = version_key(tensorrt)
        for span in self.dla_tensorrt:
            if family not in span["families"] or have < version_key(span["first"]):
                continue
            if "last" not in span or have <= version_key(span["last"]):
                return True
        return False

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


_PART_RE = re.compile(r"^p\d{4}-\d{4}$")

_FAMILY_KEYS = {"name", "soc", "match", "modules", "precisions", "precision_notes", "dla_cores",
                "jetpack", "tensorrt", "python", "notes"}
_FAMILY_REQUIRED = _FAMILY_KEYS - {"precision_notes", "notes"}
_TOP_KEYS = {"schema", "socs", "families", "cc_rules", "tensorrt_min_cc", "host",
             "jetpack_releases", "dla_tensorrt", "precision_tensorrt"}
_TOP_OPTIONAL = {"dla_tensorrt", "precision_tensorrt"}


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
    c.mapping("top level", data, required=sorted(_TOP_KEYS - _TOP_OPTIONAL), allowed=_TOP_KEYS)
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
    for prec, first in c.mapping("precision_tensorrt", data.get("precision_tensorrt") or {},
                                 allowed=PRECISIONS).items():
        c.version("precision_tensorrt." + prec, first)
    for major, cc in c.mapping("tensorrt_min_cc", data["tensorrt_min_cc"]).items():
        c.version("tensorrt_min_cc key", major)
        c.version("tensorrt_min_cc." + str(major), cc)
    host = c.mapping("host", data["host"], required=("name", "backend", "precisions"),
                     allowed=("name", "backend", "precisions", "notes"))
    c.string("host.name", host["name"])
    if host["backend"] != "onnxruntime":
        c.fail("host.backend", "'onnxruntime'", host["backend"])
    c.levels("host.precisions", host["precisions"])
    for i, span in enumerate(data.get("dla_tensorrt") or []):
        where = "dla_tensorrt[{}]".format(i)
        c.mapping(where, span, required=("first", "families"),
                  allowed=("first", "last", "families", "strongly_typed_only"))
        for key in ("first", "last"):
            if key in span:
                c.version("{}.{}".format(where, key), span[key])
        for fam in span["families"]:
            if fam not in data["families"]:
                c.fail(where + ".families", "a family of this file", fam)
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
