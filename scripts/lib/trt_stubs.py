"""Prepare TensorRT type stubs for mypy: ``python scripts/lib/trt_stubs.py [TARGET]``.

TensorRT cannot be installed on a machine without an NVIDIA stack, but ``tensorrt-stubs``
(the 10.13 API) can be downloaded on its own. Its normal install pulls the ``tensorrt``
metapackage, so fetch it with ``pip download --no-deps`` and copy the stub files into TARGET
(default ``.stubs``, mypy's ``mypy_path``), repairing what stops mypy from parsing them:

- parameters called ``in`` (a keyword) become ``in_``;
- a parameter without a default that follows a defaulted one gets ``= ...``;
- ``typing_extensions`` is imported where the stubs use it without importing it.

Errors inside the stubs stay silenced by pyproject's ``ignore_errors`` for ``tensorrt.*``;
what mypy reports is our misuse of the API. A stamp makes a second run a no-op.
"""

import ast
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import List

STUBS_VERSION = "10.13.0.35.1"
# (path inside the wheel, path under TARGET)
FILES = (
    ("tensorrt/__init__.pyi", "tensorrt/__init__.pyi"),
    ("tensorrt_bindings/__init__.pyi", "tensorrt_bindings/__init__.pyi"),
    ("tensorrt_bindings/tensorrt.pyi", "tensorrt_bindings/tensorrt.pyi"),
)

_DEF = re.compile(r"^(\s*def \w+\()(.*)(\)(?:\s*->.*)?:\s*)$")


def split_params(params: str) -> List[str]:
    """Split a parameter list on the commas that are not inside brackets or strings."""
    out, depth, start, quote = [], 0, 0, ""
    for i, ch in enumerate(params):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(params[start:i])
            start = i + 1
    if params[start:].strip():
        out.append(params[start:])
    return out


def fix_params(params: str) -> str:
    """Rename ``in`` and default the parameters that follow a defaulted one."""
    fixed = []
    seen_default = False
    keyword_only = False
    for raw in split_params(params):
        param = re.sub(r"^(\s*)in(\s*[:=]|\s*$)", r"\1in_\2", raw)
        name = param.strip()
        if name.startswith("*"):
            keyword_only = True  # after * / *args a missing default is legal
        elif "=" in _strip_annotation(name):
            seen_default = True
        elif seen_default and not keyword_only:
            param = param.rstrip() + " = ..."
        fixed.append(param)
    return ",".join(fixed)


def _strip_annotation(param: str) -> str:
    """``name: T = v`` -> ``name = v`` (annotations may hold '=' only inside brackets)."""
    name, sep, rest = param.partition(":")
    if not sep:
        return param
    depth = 0
    for i, ch in enumerate(rest):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "=" and depth == 0:
            return name + rest[i:]
    return name


def fix_stub(text: str) -> str:
    lines = text.replace("\r\n", "\n").split("\n")
    for i, line in enumerate(lines):
        m = _DEF.match(line)
        if m:
            lines[i] = m.group(1) + fix_params(m.group(2)) + m.group(3)
    out = "\n".join(lines)
    if "typing_extensions." in out and "import typing_extensions" not in out:
        out = out.replace("import typing\n", "import typing\nimport typing_extensions\n", 1)
    return out


def _stamp() -> str:
    with open(os.path.abspath(__file__), "rb") as f:
        return STUBS_VERSION + " " + hashlib.sha256(f.read()).hexdigest()


def _download(cache: str) -> str:
    wheel = os.path.join(cache, "tensorrt_stubs-{}-py3-none-any.whl".format(STUBS_VERSION))
    if not os.path.exists(wheel):
        os.makedirs(cache, exist_ok=True)
        subprocess.check_call(
            [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
             "--no-deps", "--only-binary=:all:", "-d", cache,
             "tensorrt-stubs=={}".format(STUBS_VERSION)],
            stdout=sys.stderr,
        )
    if not os.path.exists(wheel):
        raise SystemExit("pip download did not produce {}".format(wheel))
    return wheel


def prepare(target: str) -> bool:
    """Prepare TARGET; returns False when it was already prepared."""
    stamp_path = os.path.join(target, ".prepared")
    want = _stamp()
    try:
        with open(stamp_path) as f:
            done = f.read().strip() == want
    except OSError:
        done = False
    if done and all(os.path.isfile(os.path.join(target, dest)) for _, dest in FILES):
        return False
    wheel = _download(os.path.join(target, ".cache"))
    staging = tempfile.mkdtemp(prefix=".staging-", dir=target)
    try:
        with zipfile.ZipFile(wheel) as zf:
            for member, dest in FILES:
                text = fix_stub(zf.read(member).decode("utf-8"))
                ast.parse(text, filename=dest)  # fail here, not inside mypy
                path = os.path.join(staging, dest)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    f.write(text)
        for package in sorted({dest.split("/")[0] for _, dest in FILES}):
            shutil.rmtree(os.path.join(target, package), ignore_errors=True)
            os.replace(os.path.join(staging, package), os.path.join(target, package))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    with open(stamp_path, "w") as f:
        f.write(want + "\n")
    return True


def main(argv: List[str]) -> int:
    target = os.path.abspath(argv[1] if len(argv) > 1 else ".stubs")
    os.makedirs(target, exist_ok=True)
    done = prepare(target)
    print("{} TensorRT stubs {} in {}".format(
        "prepared" if done else "already prepared", STUBS_VERSION, target))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
