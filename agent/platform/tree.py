"""Reading the tree under a root (``/`` or a recorded copy) and matching what it says against the
support matrix: the SoC, the family and the module, the DLA cores."""

import glob
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from agent.errors import AgentError
from agent.platform.matrix import Matrix
from agent.platform.parsers import DEVFREQ_DIR, DLA_GLOBS


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
