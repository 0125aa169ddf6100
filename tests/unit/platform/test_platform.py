"""Platform detection over recorded device trees, and jtop's board info through a stand-in for
the jtop service client (a hardware boundary). The support matrix: test_platform_matrix.py."""

import json
import os
import re
import shutil
import time

import pytest
from jtop import JtopException

from agent import platform as plat
from agent.errors import AgentError

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "platforms")


def fixture(name):
    return os.path.join(FIXTURES, name)


class FakeJtop(object):
    """Stands in for ``jtop.jtop`` (the jtop service client) with a recorded board, engine
    groups and stats dict; can fail to start, start slowly, or drop the connection."""

    def __init__(self, recording=None, fail=None, delay=0.0, drop_after=None):
        recording = recording or load_jtop_recording()
        self._board = recording["board"]
        self._engine = recording.get("engine", {})
        self._stats = recording["stats"]
        self.fail = fail
        self.delay = delay
        self.drop_after = drop_after
        self.ok_calls = 0
        self.started = self.closed = False

    def start(self):
        if self.delay:
            time.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        self.started = True

    def ok(self, spin=False):
        self.ok_calls += 1
        return self.drop_after is None or self.ok_calls <= self.drop_after

    @property
    def board(self):
        return self._board

    @property
    def engine(self):
        return self._engine

    @property
    def stats(self):
        return dict(self._stats)

    def close(self):
        self.closed = True


def load_jtop_recording(name="agx-orin"):
    with open(os.path.join(fixture(name), "jtop.json")) as f:
        return json.load(f)


# --------------------------------------------------------------------------- detection

# fixture, family, module part, soc, CC, L4T, JetPack, TensorRT, DLA cores, kind
EXPECTED = [
    ("nano", "nano", None, "tegra210", "5.3", "32.7.1", "4.6.1", "8.2.1.8", 0),
    ("tx1", "tx1", None, "tegra210", "5.3", "32.7.4", "4.6.4", "8.2.1", 0),
    ("tx2", "tx2", None, "tegra186", "6.2", "32.7.3", "4.6.3", "8.2.1", 0),
    ("xavier-nx", "xavier-nx", "p3668-0001", "tegra194", "7.2", "35.4.1", "5.1.2", "8.5.2", 2),
    ("agx-xavier", "agx-xavier", None, "tegra194", "7.2", "35.5.0", "5.1.3", "8.5.2", 2),
    ("orin-nano", "orin-nano", "p3767-0005", "tegra234", "8.7", "36.4.3", "6.2", "10.3.0.30", 0),
    ("orin-nx", "orin-nx", "p3767-0000", "tegra234", "8.7", "36.4.0", "6.1", "10.3.0", 2),
    ("orin-nx-8gb", "orin-nx", "p3767-0001", "tegra234", "8.7", "35.4.1", "5.1.2", "8.5.2", 1),
    ("agx-orin", "agx-orin", "p3701-0005", "tegra234", "8.7", "36.3.0", "6.0", "8.6.2.3", 2),
    ("thor", "thor", "p3834-0008", "tegra264", "11.0", "38.2.1", "7.0", "10.13.3", 0),
]


@pytest.mark.parametrize("name, family, part, soc, cc, l4t, jetpack, trt, dla", EXPECTED)
def test_detects_every_recorded_family(name, family, part, soc, cc, l4t, jetpack, trt, dla):
    info = plat.detect(fixture(name))
    assert info.kind == "jetson"
    assert info.family == family and info.matrix_row["id"] == family
    assert info.part_number == part
    assert (info.soc, info.compute_capability) == (soc, cc)
    assert (info.l4t, info.jetpack) == (l4t, jetpack)
    assert info.tensorrt == trt
    assert info.dla_cores == dla
    assert info.backend == "tensorrt"
    assert info.problems == []
    assert info.model and info.model in info.board
    assert info.memory_total_mb and info.memory_total_mb > 1000


def test_versions_come_from_the_device_before_the_table():
    nano = plat.detect(fixture("nano"))
    assert nano.cuda == "10.2.300"
    assert nano.versions_source["cuda"] == "file:/usr/local/cuda/version.txt"
    assert nano.versions_source["tensorrt"] == "dpkg:tensorrt"  # 8.2.1.8 beats libnvinfer8's
    assert nano.cudnn == "8.2.1.32"
    orin = plat.detect(fixture("orin-nano"))
    assert orin.versions_source["tensorrt"].endswith("NvInferVersion.h")  # TRT 10 header
    assert orin.cudnn == "9.3.0.75"
    tx2 = plat.detect(fixture("tx2"))
    assert tx2.versions_source["tensorrt"] == "table:JetPack 4.6.3"


def test_dla_cores_come_from_sysfs_when_present():
    info = plat.detect(fixture("agx-orin"))
    assert (info.dla_cores, info.dla_source) == (2, "sysfs")


def test_codename_models_get_the_family_name():
    assert plat.detect(fixture("tx2")).board == "quill (Jetson TX2 / TX2 NX / TX2i)"
    assert plat.detect(fixture("agx-xavier")).board == "Jetson-AGX (Jetson AGX Xavier)"


def test_corrupt_compatible_is_an_agent_error_naming_the_file():
    with pytest.raises(AgentError) as err:
        plat.detect(fixture("corrupt"))
    assert err.value.code == "bad_platform_data"
    assert os.path.join("corrupt", "proc", "device-tree", "compatible") in err.value.message
    assert "NUL-separated" in err.value.message


def _copy(tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(fixture(name), str(dst))
    return dst


def test_unreadable_release_file_names_the_file(tmp_path):
    root = _copy(tmp_path, "nano")
    release = root / "etc" / "nv_tegra_release"
    release.unlink()
    release.mkdir()  # something that exists but cannot be read as a file
    with pytest.raises(AgentError) as err:
        plat.detect(str(root))
    assert err.value.code == "bad_platform_data"
    assert str(release) in err.value.message


def test_garbled_release_file_says_what_was_expected(tmp_path):
    root = _copy(tmp_path, "nano")
    (root / "etc" / "nv_tegra_release").write_text("R32.7.1 something else\n")
    with pytest.raises(AgentError) as err:
        plat.detect(str(root))
    assert "nv_tegra_release" in err.value.message
    assert "# R36 (release), REVISION: 4.3" in err.value.message
    assert "R32.7.1 something else" in err.value.message


def test_binary_model_is_an_agent_error(tmp_path):
    root = _copy(tmp_path, "thor")
    (root / "proc" / "device-tree" / "model").write_bytes(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(AgentError) as err:
        plat.detect(str(root))
    assert "proc/device-tree/model" in err.value.message


def test_unknown_board_is_classified_by_compute_capability():
    info = plat.detect(fixture("unknown-board"))
    assert info.kind == "jetson" and info.family is None
    assert info.matrix_row["id"] == "cc-8.7"
    assert info.supported_precisions == ["fp32", "tf32", "fp16", "bf16", "int8"]
    assert len(info.problems) == 1
    assert "not in the support matrix" in info.problems[0]["problem"]
    assert "support_matrix.yaml" in info.problems[0]["fix"]


def test_unknown_soc_assumes_fp32_only(tmp_path):
    root = _copy(tmp_path, "unknown-board")
    (root / "proc" / "device-tree" / "compatible").write_bytes(b"acme,x\0nvidia,tegra999\0")
    info = plat.detect(str(root))
    assert info.supported_precisions == ["fp32"]
    assert "unknown SoC 'tegra999'" in info.problems[0]["problem"]


def test_l4t_missing_from_the_table_uses_the_nearest_release(tmp_path):
    root = _copy(tmp_path, "orin-nx")
    (root / "etc" / "nv_tegra_release").write_text(
        "# R36 (release), REVISION: 4.9, GCID: 1, BOARD: generic, EABI: aarch64, DATE: x\n")
    info = plat.detect(str(root))
    assert (info.l4t, info.jetpack) == ("36.4.9", "6.2.1")
    assert any("36.4.9" in p["problem"] for p in info.problems)


def test_l4t_from_dpkg_when_the_release_file_is_missing(tmp_path):
    root = _copy(tmp_path, "nano")
    (root / "etc" / "nv_tegra_release").unlink()
    info = plat.detect(str(root))
    assert (info.l4t, info.jetpack) == ("32.7.1", "4.6.1")
    assert info.versions_source["l4t"] == "dpkg:nvidia-l4t-core"


def test_discrete_gpu_without_compute_capability():
    info = plat.detect(fixture("dgpu"))
    assert info.kind == "dgpu" and info.board == "NVIDIA GeForce RTX 3090"
    assert info.supported_precisions == ["fp32"]
    assert "compute capability" in info.problems[0]["problem"]


def test_nvidia_smi_output_is_parsed():
    new = plat.parse_nvidia_smi("NVIDIA GeForce RTX 4090, 8.9, 550.54.15, 24564\n"
                                "NVIDIA A100-SXM4-80GB, 8.0, 550.54.15, 81920\n")
    assert new[0] == {"name": "NVIDIA GeForce RTX 4090", "compute_capability": "8.9",
                      "driver": "550.54.15", "memory_total_mb": 24564}
    old = plat.parse_nvidia_smi("Tesla T4, 470.82.01, 15109\n")
    assert old[0]["compute_capability"] is None and old[0]["driver"] == "470.82.01"


def test_this_machine_is_a_cpu_host_with_emulated_precisions():
    info = plat.detect("/", use_jtop=False)
    if info.kind != "host":
        pytest.skip("this machine has an NVIDIA GPU")
    assert info.backend == "onnxruntime"
    assert info.emulated_precisions == ["fp16", "int8"]
    assert info.supported_precisions == ["fp32", "fp16", "int8"]


def test_fingerprint_keys_and_values():
    keys = {"kind", "soc", "module", "gpu", "compute_capability", "dla_cores", "cuda",
            "tensorrt", "cudnn", "backend", "backend_version"}
    nano = plat.detect(fixture("nano")).fingerprint()
    orin = plat.detect(fixture("agx-orin")).fingerprint()
    assert set(nano) == set(orin) == keys
    assert all(isinstance(v, str) for v in list(nano.values()) + list(orin.values()))
    assert nano["soc"] == "tegra210" and nano["tensorrt"] == "8.2.1.8"
    assert nano != orin
    assert plat.detect(fixture("nano")).fingerprint("onnxruntime")["backend"] == "onnxruntime"


def test_to_dict_keys_are_documented():
    info = plat.detect(fixture("agx-orin"))
    with open(os.path.join(ROOT, "docs", "platform.md")) as f:
        doc = f.read()
    data = info.to_dict()
    json.dumps(data)  # plain JSON
    for key in data:
        assert re.search(r"`{}`".format(re.escape(key)), doc), key


def test_for_row_builds_a_platform_without_detection():
    assert plat.for_row("tx2").supported_precisions == ["fp32", "fp16"]
    assert plat.for_row("cc-8.9").level("fp8") == "native"
    assert plat.for_row("host").emulated_precisions == ["fp16", "int8"]
    with pytest.raises(AgentError) as err:
        plat.for_row("tx3")
    assert err.value.code == "bad_argument"


def test_looks_like_jetson():
    assert plat.looks_like_jetson(fixture("thor"))
    assert not plat.looks_like_jetson(fixture("dgpu"))


# --------------------------------------------------------------------------- jtop

def test_jtop_board_info_is_used_when_the_service_answers():
    fake = FakeJtop()
    info = plat.detect(fixture("agx-orin"), jtop_factory=lambda: fake)
    assert info.jtop_used and fake.closed
    assert info.tensorrt == "8.6.2.3" and info.versions_source["tensorrt"] == "jtop"
    assert info.versions_source["cuda"] == "jtop"
    assert (info.dla_cores, info.dla_source) == (2, "jtop")
    assert info.problems == []


def test_jtop_part_number_identifies_the_module(tmp_path):
    root = _copy(tmp_path, "agx-orin")
    (root / "proc" / "device-tree" / "compatible").write_bytes(b"nvidia,tegra234\0")
    (root / "proc" / "device-tree" / "model").write_bytes(b"Custom Carrier\0")
    info = plat.detect(str(root), jtop_factory=FakeJtop)
    assert info.family == "agx-orin" and info.part_number == "p3701-0005"


@pytest.mark.parametrize("error, expected, fix", [
    (JtopException("The jtop.service is not active. Please run:\nsudo jtop --install-service"),
     "jtop service not running", "sudo systemctl enable --now jtop"),
    (JtopException("I can't access jtop.service.\nPlease logout or reboot this board."),
     "user not in group jtop", "usermod -aG jtop"),
    (PermissionError(13, "Permission denied"), "user not in group jtop", "usermod -aG jtop"),
    (ConnectionRefusedError(111, "Connection refused"), "jtop service not running",
     "systemctl enable --now jtop"),
    (FileNotFoundError(2, "No such file or directory"), "jtop service not running",
     "systemctl enable --now jtop"),
    (JtopException("Mismatch version jtop service: [4.2.0] and client: [4.2.9]"),
     "versions differ", "pip3 install -U jetson-stats"),
])
def test_jtop_failures_become_problem_lines(error, expected, fix):
    info = plat.detect(fixture("orin-nano"), jtop_factory=lambda: FakeJtop(fail=error))
    assert not info.jtop_used
    assert info.family == "orin-nano"  # detection goes on without jtop
    assert len(info.problems) == 1
    assert expected in info.problems[0]["problem"] and fix in info.problems[0]["fix"]


def test_a_hanging_jtop_service_times_out():
    client, trouble = plat.connect_jtop(lambda: FakeJtop(delay=2.0), timeout=0.1)
    assert client is None and "did not answer" in trouble["problem"]


def test_jtop_is_not_asked_for_a_recorded_tree_or_with_use_jtop_false():
    calls = []
    plat.detect(fixture("nano"))  # no factory, root is not "/": never the live service
    plat.detect(fixture("nano"), use_jtop=False, jtop_factory=lambda: calls.append(1))
    assert calls == []


@pytest.mark.parametrize("tensorrt, cc, refused", [
    ("10.4.0", "7.0", False), ("10.5.0", "7.0", True), ("10.13.3", "7.2", True),
    ("10.5.0", "7.5", False), ("10.3.0", "7.2", False), ("8.5.2", "7.2", False),
    ("10.0.1", "6.1", True), ("8.6.1", "5.3", False), ("11.4.0", "7.0", True),
])
def test_volta_is_dropped_from_tensorrt_10_5(tensorrt, cc, refused):
    """Issue 24 defect 6: ``tensorrt_min_cc`` was keyed by major only ("10": "7.0"), so a Volta
    GPU (CC 7.0 / 7.2) looked fine under TensorRT 10.5+, which dropped it."""
    from agent.platform.decision import for_row
    from agent.platform.versions import _check_tensorrt_cc

    info = for_row("cc-" + cc)
    info.tensorrt = tensorrt
    _check_tensorrt_cc(info)
    assert any("needs compute capability" in p["problem"] for p in info.problems) == refused
