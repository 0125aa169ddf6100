"""GPU tests: they need pycuda and a CUDA device, and skip cleanly without either."""

import pytest


@pytest.fixture(scope="session")
def cuda_device():
    """The CUDA driver module with device 0's primary context current for the session."""
    cuda = pytest.importorskip("pycuda.driver")
    try:
        cuda.init()
        count = cuda.Device.count()
    except cuda.Error as exc:  # no driver, or a driver without a device
        pytest.skip("CUDA is not usable here: {}".format(exc))
    if count == 0:
        pytest.skip("no CUDA device")
    from agent.engines.backends.cuda_buffers import CudaContext

    ctx = CudaContext(0)
    try:
        yield cuda
    finally:
        ctx.close()


@pytest.fixture(scope="session")
def cuda_context_info(cuda_device):
    from agent.engines.backends.cuda_buffers import CudaContext, driver_version

    with CudaContext(0) as ctx:
        return {"name": ctx.name(), "cc": ctx.compute_capability(), "driver": driver_version()}
