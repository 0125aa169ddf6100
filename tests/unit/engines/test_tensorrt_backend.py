"""The tensorrt backend's GPU-free parts around the build: the calibration and timing caches,
the calibration feed (fake device buffers), and what happens without TensorRT. What a plan asks
TensorRT for is in test_tensorrt_plan.py, reading TensorRT's answers in test_tensorrt_inspect.py."""

import os
import subprocess
import sys

import numpy as np
import pytest

from agent.engines.backends import tensorrt_caches
from agent.engines.backends.base import get_backend
from agent.errors import CODES, AgentError
from calib import cache as calib_cache
from calib.calibrators import BatchFeeder, read_cache_bytes, write_cache_bytes

# -- caches ----------------------------------------------------------------------------------


def test_calibration_cache_header_tag_and_version_check(tmp_path):
    assert calib_cache.trt_version_tag("8.6.1.6") == "8601"
    assert calib_cache.trt_version_tag("8.2.1.8") == "8201"
    assert calib_cache.trt_version_tag("10.3.0.30") == "100300"
    path = str(tmp_path / "calib.cache")
    assert tensorrt_caches.existing_calibration_cache(path, "entropy2", "10.3.0.30") is None
    calib_cache.write_cache(path, {"input": 2.54, "conv": 12.7}, "entropy2", "10.3.0.30")
    with open(path) as f:
        assert f.readline().strip() == "TRT-100300-EntropyCalibration2"
    cache = tensorrt_caches.existing_calibration_cache(path, "entropy2", "10.3.0.30")
    assert cache.amax["conv"] == pytest.approx(12.7, rel=1e-6)
    with pytest.raises(AgentError) as err:  # another TensorRT: TensorRT would recalibrate
        tensorrt_caches.existing_calibration_cache(path, "entropy2", "8.6.1.6")
    assert err.value.code == "calibration_cache_mismatch" and "8601" in err.value.message
    with pytest.raises(AgentError) as err:  # another algorithm
        tensorrt_caches.existing_calibration_cache(path, "minmax", None)
    assert err.value.code == "calibration_cache_mismatch"
    # Scales used directly (Q/DQ, dynamic ranges) only need the algorithm to match.
    assert tensorrt_caches.existing_calibration_cache(path, "entropy2", None) is not None


def test_calibration_cache_bytes_round_trip(tmp_path):
    path = str(tmp_path / "sub" / "c.cache")
    assert read_cache_bytes(path) is None and read_cache_bytes(None) is None
    write_cache_bytes(path, memoryview(b"TRT-8601-EntropyCalibration2\nx: 3c010a14\n"))
    assert read_cache_bytes(path).startswith(b"TRT-8601-")


def test_timing_cache_path_under_the_state_dir(tmp_path):
    path = tensorrt_caches.timing_cache_path("8.6.2.3", "Orin (nvgpu)-sm87")
    assert path == str(tmp_path / "state" / "timing" / "8.6.2.3-Orin_nvgpu_-sm87.cache")


class FakeTimingCache(object):
    """ITimingCache stand-in: a set of entries, serialized one per line."""

    def __init__(self, data):
        if data.startswith(b"corrupt"):
            raise RuntimeError("Deserialization of timing cache failed")
        self.entries = set(line for line in data.decode().split("\n") if line)

    def combine(self, other, ignore_mismatch):
        assert ignore_mismatch is False
        self.entries |= other.entries
        return True

    def serialize(self):
        return "\n".join(sorted(self.entries)).encode()


class FakeTimingConfig(object):
    def __init__(self):
        self.cache = None
        self.ignore_mismatch = None

    def create_timing_cache(self, data):
        return FakeTimingCache(bytes(data))

    def set_timing_cache(self, cache, ignore_mismatch):
        self.cache, self.ignore_mismatch = cache, ignore_mismatch
        return True

    def get_timing_cache(self):
        return self.cache


def test_timing_cache_is_loaded_and_merged_with_what_is_on_disk(tmp_path):
    path = str(tmp_path / "timing" / "t.cache")
    first, second = FakeTimingConfig(), FakeTimingConfig()
    tensorrt_caches.TimingCache(path).attach(first)
    tensorrt_caches.TimingCache(path).attach(second)  # both builds start from an empty cache
    assert first.ignore_mismatch is False
    first.cache.entries.add("conv tactic A")
    second.cache.entries.add("gemm tactic B")
    tensorrt_caches.TimingCache(path).save(first)
    tensorrt_caches.TimingCache(path).save(second)  # merges with what the first one wrote
    with open(path, "rb") as f:
        assert f.read() == b"conv tactic A\ngemm tactic B"
    third = FakeTimingConfig()
    cache = tensorrt_caches.TimingCache(path)
    cache.attach(third)
    assert cache.loaded_bytes > 0 and third.cache.entries == {"conv tactic A", "gemm tactic B"}


def test_unreadable_timing_cache_is_ignored(tmp_path):
    path = tmp_path / "t.cache"
    path.write_bytes(b"corrupt bytes")
    config = FakeTimingConfig()
    cache = tensorrt_caches.TimingCache(str(path))
    cache.attach(config)
    assert cache.loaded_bytes == 0 and config.cache.entries == set()
    config.cache.entries.add("x")
    cache.save(config)  # the corrupt file is replaced, not merged
    assert path.read_bytes() == b"x"


# -- calibration feed (fake device buffers: the CUDA boundary) -------------------------------

class FakeDeviceBuffers(object):
    def __init__(self):
        self.uploads = []
        self.freed = False

    def upload(self, arrays, dtypes=None):
        self.uploads.append({n: np.asarray(a, dtype=(dtypes or {}).get(n, np.asarray(a).dtype))
                             for n, a in arrays.items()})
        return {n: 1000 * len(self.uploads) + i for i, n in enumerate(sorted(arrays))}

    def free(self):
        self.freed = True


def test_batch_feeder_order_end_and_errors():
    batches = [{"a": np.full((2, 3), k, np.float64), "b": np.full((2,), k)} for k in range(3)]
    buffers = FakeDeviceBuffers()
    progress = []
    feeder = BatchFeeder(batches, 2, {"a": np.float32}, buffers=buffers,
                         progress=lambda *p: progress.append(p), total=3)
    assert feeder.get_batch(["b", "a"]) == [1001, 1000]  # in the order TensorRT names them
    assert buffers.uploads[0]["a"].dtype == np.float32
    assert feeder.get_batch(["a", "b"]) is not None
    assert feeder.get_batch(["a", "b"]) is not None
    assert feeder.get_batch(["a", "b"]) is None and feeder.batches_fed == 3
    assert progress[-1] == ("calibrating", 3, 3)
    feeder.close()
    assert buffers.freed
    wrong = BatchFeeder([{"a": np.zeros((2, 4))}], 2, buffers=FakeDeviceBuffers(),
                        shapes={"a": (2, 3)})
    with pytest.raises(AgentError) as err:
        wrong.get_batch(["a"])
    assert "expected shape [2, 3] (the calibration profile), found [2, 4]" in err.value.message
    missing = BatchFeeder([{"a": np.zeros((2, 3))}], 2, buffers=FakeDeviceBuffers())
    with pytest.raises(AgentError) as err:
        missing.get_batch(["a", "b"])
    assert err.value.code == "bad_calibration_data" and "inputs a, b" in err.value.message


# -- no TensorRT here ------------------------------------------------------------------------

def test_imports_stay_light():
    """Importing the backend and the calibrators loads neither TensorRT nor pycuda (checked in
    a fresh interpreter: other tests in this process may have imported pycuda)."""
    code = ("import sys, agent.engines.backends.tensorrt, calib.calibrators,"
            " agent.engines.backends.cuda_buffers;"
            "print(sorted(m for m in ('tensorrt', 'pycuda') if m in sys.modules))")
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    out = subprocess.check_output([sys.executable, "-c", code], cwd=root)
    assert out.decode().strip() == "[]"


def test_get_backend_without_tensorrt_is_backend_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    with pytest.raises(AgentError) as err:
        get_backend("tensorrt")
    assert err.value.code == "backend_unavailable"
    assert "TensorRT" in err.value.message and "--backend onnxruntime" in err.value.message


def test_codes_used_are_registered():
    for code in ("backend_unavailable", "dynamic_shape", "unsupported_model", "bad_model",
                 "build_failed", "bad_engine", "unknown_layer", "calibration_cache_mismatch",
                 "bad_calibration_data", "unsupported_precision"):
        assert code in CODES
