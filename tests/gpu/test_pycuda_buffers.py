"""The tensorrt backend's CUDA side on a real GPU, without TensorRT: device copies of
calibration batches, runner I/O buffers, CUDA-event timing."""

import os

import numpy as np
import pytest

from agent.engines.backends.base import TensorSpec
from agent.errors import AgentError

pytestmark = pytest.mark.gpu

DTYPES = [np.float32, np.float16, np.float64, np.int8, np.uint8, np.int32, np.int64, np.bool_]
SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4, 5), (0, 3)]


def _sample(shape, dtype, seed):
    rng = np.random.RandomState(seed)
    if dtype == np.bool_:
        values = rng.rand(*shape) > 0.5
    elif np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        values = rng.randint(max(info.min, -1000), min(info.max, 1000), size=shape)
    else:
        values = rng.randn(*shape) * 100
    return np.asarray(values, dtype=dtype)  # 0-d draws come back as Python scalars


def test_context_reports_the_device(cuda_context_info):
    assert cuda_context_info["name"]
    major, _minor = cuda_context_info["cc"]
    assert major >= 3
    assert cuda_context_info["driver"].count(".") == 1


def test_context_reports_sm_count_and_cuda_version(cuda_device):
    """What the engine platform record (issue 24) reads from CUDA: the SM count and the CUDA
    version pycuda was built against."""
    from agent.engines.backends.cuda_buffers import CudaContext, cuda_version

    with CudaContext(0) as ctx:
        assert ctx.sm_count() > 0
    major, minor = (int(p) for p in cuda_version().split("."))
    assert major >= 10 and minor >= 0


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_device_buffers_round_trip_every_shape(cuda_device, dtype):
    from agent.engines.backends.cuda_buffers import DeviceBuffers

    buffers = DeviceBuffers()
    try:
        for seed, shape in enumerate(SHAPES):
            host = _sample(shape, dtype, seed)
            pointers = buffers.upload({"x": host})
            assert pointers["x"] == buffers.pointer("x") and pointers["x"] > 0
            back = buffers.download("x", host.shape, host.dtype)
            np.testing.assert_array_equal(back, host)
    finally:
        buffers.free()


def test_device_buffers_cast_non_contiguous_and_grow(cuda_device):
    from agent.engines.backends.cuda_buffers import DeviceBuffers

    buffers = DeviceBuffers()
    try:
        small = np.arange(12, dtype=np.float64).reshape(3, 4).T  # not contiguous
        buffers.upload({"a": small}, {"a": np.float16})
        np.testing.assert_array_equal(buffers.download("a", (4, 3), np.float16),
                                      small.astype(np.float16))
        big = np.arange(10000, dtype=np.float32)
        buffers.upload({"a": big})  # grows the allocation
        np.testing.assert_array_equal(buffers.download("a", big.shape, big.dtype), big)
        grown = buffers.pointer("a")
        buffers.upload({"a": big[:10]})  # fits: the allocation is reused
        assert buffers.pointer("a") == grown
        np.testing.assert_array_equal(buffers.download("a", (10,), np.float32), big[:10])
        with pytest.raises(ValueError):
            buffers.download("a", (20000,), np.float32)
    finally:
        buffers.free()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.int8, np.bool_],
                         ids=lambda d: np.dtype(d).name)
def test_io_buffers_host_device_host(cuda_device, dtype):
    """Runner I/O: pinned input -> device, device-side copy (stands in for the engine) into an
    output buffer, device -> pinned output, all on one stream."""
    from agent.engines.backends.cuda_buffers import IOBuffers

    cuda = cuda_device
    io = IOBuffers()
    try:
        for seed, shape in enumerate([(2, 3), (8, 16, 4), (5,)]):  # shapes change per call
            feed = _sample(shape, dtype, seed)
            io.set_input("in", feed, dtype)
            out = io.ensure("out", shape, dtype)
            assert out.shape == tuple(shape) and out.dtype == np.dtype(dtype)
            io.to_device(["in"])
            cuda.memcpy_dtod_async(io.device_ptr("out"), io.device_ptr("in"), feed.nbytes,
                                   io.stream)
            io.to_host(["out"])
            io.synchronize()
            np.testing.assert_array_equal(io.host("out"), feed)
    finally:
        io.free()


def _write_shards(directory, n_samples, shard_size):
    """A real calibration dataset on disk: .npz shards with two inputs."""
    rng = np.random.RandomState(0)
    x = rng.randn(n_samples, 3, 8, 8).astype(np.float32)
    ids = rng.randint(0, 100, size=(n_samples, 5)).astype(np.int64)
    for k, start in enumerate(range(0, n_samples, shard_size)):
        np.savez(os.path.join(str(directory), "shard_{:03d}.npz".format(k)),
                 x=x[start:start + shard_size], ids=ids[start:start + shard_size])
    return x, ids


def test_batch_feeder_delivers_each_calibration_batch_to_the_device(cuda_device, tmp_path):
    from calib.calibrators import BatchFeeder
    from calib.dataset import CalibrationDataset

    cuda = cuda_device
    x, ids = _write_shards(tmp_path, n_samples=22, shard_size=3)
    specs = [TensorSpec("x", np.float16, (4, 3, 8, 8)), TensorSpec("ids", np.int32, (4, 5))]
    dataset = CalibrationDataset(str(tmp_path), specs, batch_size=4)
    assert dataset.num_batches() == 5  # 22 samples, fixed batch of 4: the last 2 are dropped
    seen = []
    feeder = BatchFeeder(dataset, 4, {"x": np.float16, "ids": np.int32},
                         progress=lambda stage, done, total: seen.append((stage, done, total)),
                         total=dataset.num_batches())
    try:
        for k in range(dataset.num_batches()):
            pointers = feeder.get_batch(["x", "ids"])
            assert pointers is not None and len(pointers) == 2 and all(p > 0 for p in pointers)
            got_x = np.empty((4, 3, 8, 8), np.float16)
            got_ids = np.empty((4, 5), np.int32)
            cuda.memcpy_dtoh(got_x, pointers[0])
            cuda.memcpy_dtoh(got_ids, pointers[1])
            np.testing.assert_array_equal(got_x, x[4 * k:4 * k + 4].astype(np.float16))
            np.testing.assert_array_equal(got_ids, ids[4 * k:4 * k + 4].astype(np.int32))
        assert feeder.get_batch(["x", "ids"]) is None
        assert feeder.get_batch(["x", "ids"]) is None  # stays exhausted
        assert feeder.batches_fed == 5
        assert seen[-1] == ("calibrating", 5, 5)
    finally:
        feeder.close()


def test_batch_feeder_refuses_a_batch_of_the_wrong_size(cuda_device):
    from calib.calibrators import BatchFeeder

    batches = [{"x": np.zeros((4, 2), np.float32)}, {"x": np.zeros((3, 2), np.float32)}]
    feeder = BatchFeeder(batches, 4)
    try:
        assert feeder.get_batch(["x"]) is not None
        with pytest.raises(AgentError) as err:
            feeder.get_batch(["x"])
        assert err.value.code == "bad_calibration_data"
        assert "expected 4 samples, found 3" in err.value.message
    finally:
        feeder.close()
    profiled = BatchFeeder([{"x": np.zeros((4, 3), np.float32)}], 4, shapes={"x": (4, 2)})
    try:
        with pytest.raises(AgentError) as err:
            profiled.get_batch(["x"])
        assert "expected shape [4, 2] (the calibration profile), found [4, 3]" in err.value.message
    finally:
        profiled.close()


def test_event_timer_times_queued_work(cuda_device):
    from agent.engines.backends.cuda_buffers import EventTimer, IOBuffers

    io = IOBuffers()
    try:
        io.set_input("x", np.ones((1024, 1024, 4), np.float32), np.float32)  # 16 MiB
        timer = EventTimer(io.stream)
        times = timer.time(lambda: io.to_device(["x"]), iterations=5, warmup=1)
        assert len(times) == 5
        assert all(isinstance(t, float) and t > 0 for t in times)
        with pytest.raises(AgentError):
            timer.time(lambda: None, iterations=0)
    finally:
        io.free()


def test_calibration_uploads_non_index_inputs_as_float32(cuda_device):
    """Issue 24 defect 2 on a real GPU: uint8 / int8 / float16 calibration inputs reach the
    device as float32 (what TensorRT reads: 4 bytes per element), index inputs in their own
    type, through ``calibration_dtypes`` and ``BatchFeeder``'s pycuda uploads."""
    from calib.calibrators import BatchFeeder, calibration_dtypes

    cuda = cuda_device
    rng = np.random.RandomState(3)
    specs = [TensorSpec("img", np.uint8, (2, 3, 4, 4)), TensorSpec("q", np.int8, (2, 6)),
             TensorSpec("h", np.float16, (2, 5)), TensorSpec("ids", np.int64, (2, 7)),
             TensorSpec("mask", np.bool_, (2, 7))]
    dtypes = calibration_dtypes(specs)
    want = {"img": np.float32, "q": np.float32, "h": np.float32, "ids": np.int64,
            "mask": np.bool_}
    assert {n: np.dtype(t) for n, t in dtypes.items()} == \
        {n: np.dtype(t) for n, t in want.items()}
    batches = [{
        "img": rng.randint(0, 256, (2, 3, 4, 4)).astype(np.uint8),
        "q": rng.randint(-128, 128, (2, 6)).astype(np.int8),
        "h": rng.randn(2, 5).astype(np.float16),
        "ids": rng.randint(0, 1 << 40, (2, 7)).astype(np.int64),
        "mask": rng.rand(2, 7) > 0.5,
    } for _ in range(3)]
    names = [s.name for s in specs]
    feeder = BatchFeeder(batches, 2, dtypes, shapes={s.name: s.shape for s in specs})
    try:
        for batch in batches:
            pointers = feeder.get_batch(names)
            assert pointers is not None and all(p > 0 for p in pointers)
            for name, ptr in zip(names, pointers):
                got = np.empty(batch[name].shape, want[name])
                cuda.memcpy_dtoh(got, ptr)
                np.testing.assert_array_equal(got, batch[name].astype(want[name]))
        assert feeder.get_batch(names) is None
    finally:
        feeder.close()
