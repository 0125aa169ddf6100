"""trtexec's phase split on a real GPU without TensorRT: ``EventTimer.time_phases`` around real
host-to-device copies, a stand-in execute that queues real device work (a device-to-device copy
of the input into the output) and real device-to-host copies, all on the runner's stream. Run
with ``python -m pytest tests/gpu``."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

SHAPE = (1024, 1024, 4)  # 16 MiB of float32: copies long enough for the events to resolve


def test_phases_of_real_copies_and_device_work(cuda_device):
    from agent.engines.backends.cuda_buffers import EventTimer, IOBuffers

    io = IOBuffers()
    timer = EventTimer(io.stream)
    try:
        x = np.random.RandomState(0).rand(*SHAPE).astype(np.float32)
        io.set_input("x", x, np.float32)
        io.ensure("y", SHAPE, np.float32)
        executes = []

        def execute():
            executes.append(1)
            cuda_device.memcpy_dtod_async(io.device_ptr("y"), io.device_ptr("x"), x.nbytes,
                                          io.stream)

        rows = timer.time_phases(lambda: io.to_device(["x"]), execute,
                                 lambda: io.to_host(["y"]), iterations=5)
        assert len(rows) == 5 and len(executes) == 5
        for row in rows:
            assert sorted(row) == ["compute", "d2h", "enqueue", "h2d"]
            assert all(isinstance(v, float) for v in row.values())
            # Each phase held real work, and the events are ordered on the one stream.
            assert row["h2d"] > 0 and row["compute"] > 0 and row["d2h"] > 0
            assert row["enqueue"] >= 0
        # The last D2H event was waited on: the output is complete on the host.
        np.testing.assert_array_equal(io.host("y"), x)
    finally:
        timer.close()
        io.close()


def test_phases_with_nothing_queued_are_not_negative(cuda_device):
    """Empty phases (a zero-size tensor copies nothing) read as ~0, never as an error."""
    from agent.engines.backends.cuda_buffers import EventTimer, IOBuffers

    io = IOBuffers()
    timer = EventTimer(io.stream)
    try:
        io.set_input("x", np.zeros((0, 3), np.float32), np.float32)
        rows = timer.time_phases(lambda: io.to_device(["x"]), lambda: None,
                                 lambda: io.to_host(["x"]), iterations=2)
        assert len(rows) == 2
        assert all(v >= 0 for row in rows for v in row.values())
    finally:
        timer.close()
        io.close()
