"""The per-JetPack requirement sets: what each pins, and that pip can resolve them for the
Python each JetPack ships (``pip install --dry-run --python-version ...``; skipped with the
reason when PyPI cannot be reached)."""

import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Built on the device from its sdist (no wheels on PyPI): not part of the wheel-only check.
SOURCE_ONLY = ("pycuda",)


def requirement_lines(name):
    """The requirements a file names itself (no comments, no ``-r`` includes)."""
    out = []
    with open(os.path.join(ROOT, name)) as f:
        for line in f:
            line = line.split("#", 1)[0].strip().replace(" ", "")
            if line and not line.startswith("-"):
                out.append(line)
    return out


def all_requirements(name):
    """Every requirement a file brings in, following ``-r`` includes."""
    out = []
    with open(os.path.join(ROOT, name)) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line.startswith("-r "):
                out.extend(all_requirements(line[3:].strip()))
    return out + requirement_lines(name)


def test_jetpack_4_worker_set_fits_python_3_6():
    lines = requirement_lines("requirements-jetson4.txt")
    assert "onnx>=1.10,<1.12" in lines  # 1.11 is the last onnx with cp36 wheels
    assert "numpy>=1.19,<1.20" in lines
    assert "polygraphy>=0.33,<=0.53.4" in lines


def test_jetpack_5_set_keeps_numpy_below_1_24():
    with open(os.path.join(ROOT, "requirements-jetson5.txt")) as f:
        assert "-r requirements.txt" in f.read()
    assert "numpy>=1.19,<1.24" in requirement_lines("requirements-jetson5.txt")


def _lower_bound(requirement):
    """``pkg>=1.2,<2`` -> (1, 2)."""
    for clause in requirement.split(",")[0:]:
        clause = re.sub(r"^[A-Za-z0-9_.-]+", "", clause)
        if clause.startswith(">="):
            return tuple(int(p) for p in clause[2:].split("."))
    return ()


def test_jetpack_6_and_7_set_has_a_pycuda_that_builds_against_cuda_13():
    """Issue 24 defect 9: ``pycuda>=2021.1`` allowed releases that do not build against CUDA 13
    (JetPack 7); the fix (inducer/pycuda PR 487) is in 2025.1.2."""
    (pin,) = [r for r in requirement_lines("requirements-jetson.txt") if r.startswith("pycuda")]
    assert _lower_bound(pin) >= (2025, 1, 2), pin


def _pypi_problem():
    """Why PyPI's simple index cannot be read from here (proxies honoured), or None."""
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10).close()
        return None
    except (OSError, ValueError) as exc:  # URLError is an OSError
        return str(exc)


@pytest.mark.parametrize("name,python,abi", [
    ("requirements-jetson4.txt", "3.6", "cp36m"),
    ("requirements-jetson5.txt", "3.8", "cp38"),
])
def test_pip_resolves_the_set_for_the_jetpack_python(tmp_path, name, python, abi):
    problem = _pypi_problem()
    if problem:
        pytest.skip("PyPI is not reachable ({}): cannot check {} with pip".format(problem, name))
    wanted = [r for r in all_requirements(name)
              if re.split(r"[<>=!~;\[]", r, maxsplit=1)[0].lower() not in SOURCE_ONLY]
    report = str(tmp_path / "report.json")
    # --isolated: this machine's pip configuration (extra indexes, constraints) stays out.
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run",
           "--ignore-installed", "--disable-pip-version-check", "--report", report,
           "--python-version", python,
           "--implementation", "cp", "--abi", abi, "--platform", "manylinux2014_aarch64",
           "--only-binary=:all:"] + wanted
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    if proc.returncode != 0 and any(w in proc.stdout for w in (
            "NewConnectionError", "Max retries exceeded", "Temporary failure in name",
            "Could not fetch URL", "ReadTimeoutError")):
        pytest.skip("PyPI stopped answering during the check: {}".format(
            proc.stdout.strip().splitlines()[-1]))
    assert proc.returncode == 0, proc.stdout
    with open(report) as f:
        got = {i["metadata"]["name"].lower(): i["metadata"]["version"]
               for i in json.load(f)["install"]}
    numpy = tuple(int(p) for p in got["numpy"].split(".")[:2])
    assert numpy < ((1, 24) if python == "3.8" else (1, 20))
    if python == "3.6":
        assert tuple(int(p) for p in got["onnx"].split(".")[:2]) < (1, 12)
    else:  # JetPack 5 runs the daemon too: requirements.txt resolves there as a whole
        assert {"onnx", "onnxruntime", "paho-mqtt", "cryptography", "fastjsonschema"} <= set(got)
        # 2.22 needs Python >= 3.10: the range must leave pip a 3.8 release (2.21.x).
        assert tuple(int(p) for p in got["fastjsonschema"].split(".")[:2]) >= (2, 21)
