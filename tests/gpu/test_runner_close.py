"""Issue 11, defect 10, on a real GPU without TensorRT: a runner's stream and events are freed
while their context is current. pycuda destroys a Stream / Event when its last reference goes
and, once the context is detached, skips cuStreamDestroy / cuEventDestroy with a warning on
stderr (a leak per runner). Run with ``python -m pytest tests/gpu``."""

import gc
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_close_drops_every_reference_to_stream_and_events(cuda_device):
    from agent.engines.backends.cuda_buffers import CudaContext, EventTimer, IOBuffers

    with CudaContext(0):
        buffers = IOBuffers()
        timer = EventTimer(buffers.stream)
        buffers.set_input("x", np.arange(6, dtype=np.float32), np.float32)
        buffers.to_device(["x"])
        assert len(timer.time(lambda: buffers.to_device(["x"]), 2)) == 2
        stream, events = buffers.stream, [timer._start, timer._end]
        timer.close()
        buffers.close()
        # Only this test's own names still point at them (plus getrefcount's argument):
        # dropping these destroys them now, with the context current. Counted outside the
        # asserts, whose rewriting keeps extra references to subexpressions.
        counts = [sys.getrefcount(stream), sys.getrefcount(events[0]),
                  sys.getrefcount(events[1])]
        assert counts == [2, 2, 2]
        del stream, events
        gc.collect()


def test_no_cleanup_warning_after_the_context_is_gone(cuda_device, capfd):
    from agent.engines.backends.cuda_buffers import CudaContext, EventTimer, IOBuffers

    ctx = CudaContext(0)
    buffers = IOBuffers()
    timer = EventTimer(buffers.stream)
    timer.close()
    buffers.close()
    ctx.close()
    del timer, buffers
    gc.collect()
    err = capfd.readouterr().err
    assert "clean-up operation failed" not in err and "dead context" not in err


def test_a_closed_timer_and_buffers_refuse_work(cuda_device):
    from agent.engines.backends.cuda_buffers import CudaContext, EventTimer, IOBuffers

    with CudaContext(0):
        buffers = IOBuffers()
        timer = EventTimer(buffers.stream)
        timer.close()
        buffers.close()
        assert buffers.stream is None and timer.stream is None
