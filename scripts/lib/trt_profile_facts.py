"""Read the enum facts of a TensorRT version from NVIDIA's headers, for tests/trt_profiles/.

    python scripts/lib/trt_profile_facts.py TENSORRT_CHECKOUT TAG

TENSORRT_CHECKOUT is a git clone of github.com/NVIDIA/TensorRT (its tags: 8.0.1, 8.2.1, 8.5.2,
v8.6.1, v10.3.0, v10.13.3, v11.1, ...). Prints JSON: the Python names and values of
``BuilderFlag``, ``NetworkDefinitionCreationFlag``, ``LayerType`` and ``DataType`` as declared in
``include/*.h`` at TAG (``kFP16`` -> ``FP16``; values counted as the compiler does, explicit
``= N`` honoured), and the aliases ``trt.nptype`` maps (from ``python/packaging``), with
whether it still spells ``np.bool`` (gone in NumPy 1.24). The profiles' other facts (which
calls exist) are written by hand with their sources; this script only reads what is regular.
"""

import json
import re
import subprocess
import sys
from typing import Dict, List, Optional

ENUMS = ("BuilderFlag", "NetworkDefinitionCreationFlag", "LayerType", "DataType")
NPTYPE_FILES = ("python/packaging/bindings_wheel/tensorrt/__init__.py",
                "python/packaging/tensorrt/__init__.py")
_MEMBER = re.compile(r"^\s*k([A-Z0-9_]+)\b(?:\s+TRT_DEPRECATED_ENUM)?\s*(?:=\s*(-?\d+))?\s*,?")


def git_show(repo: str, tag: str, path: str) -> Optional[str]:
    try:
        return subprocess.check_output(["git", "-C", repo, "show", "{}:{}".format(tag, path)],
                                       stderr=subprocess.DEVNULL).decode("utf-8", "replace")
    except subprocess.CalledProcessError:
        return None


def headers(repo: str, tag: str) -> List[str]:
    names = subprocess.check_output(["git", "-C", repo, "ls-tree", "--name-only", tag,
                                     "include/"]).decode().split()
    return [text for text in (git_show(repo, tag, n) for n in names if n.endswith(".h"))
            if text]


def enum_members(texts: List[str], name: str) -> Dict[str, int]:
    """``enum class NAME ... { kA, kB = 5, ... };`` -> {"A": 0, "B": 5}."""
    for text in texts:
        match = re.search(r"^enum class {}\b[^{{]*\{{(.*?)^\}};".format(name), text, re.S | re.M)
        if not match:
            continue
        out: Dict[str, int] = {}
        value = -1
        for line in match.group(1).split("\n"):
            line = line.split("//")[0]
            m = _MEMBER.match(line)
            if m:
                value = int(m.group(2)) if m.group(2) is not None else value + 1
                out[m.group(1)] = value
        return out
    return {}


def nptype_table(repo: str, tag: str) -> Dict[str, object]:
    for path in NPTYPE_FILES:
        text = git_show(repo, tag, path)
        if not text or "def nptype" not in text:
            continue
        body = text.split("def nptype", 1)[1].split("raise TypeError", 1)[0]
        pairs = re.findall(r"^\s*(\w+):\s*np\.(\w+),", body, re.M)
        return {"file": path, "table": [alias for alias, _ in pairs],
                "bool_via_np_bool": ("bool", "bool") in pairs}
    return {}


def facts(repo: str, tag: str) -> Dict[str, object]:
    texts = headers(repo, tag)
    out: Dict[str, object] = {"tag": tag}
    for name in ENUMS:
        out[name] = enum_members(texts, name)
    out["nptype"] = nptype_table(repo, tag)
    return out


def main(argv: List[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    print(json.dumps(facts(argv[1], argv[2]), indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
