"""Builds through the fake TensorRT (``tests/fake_trt.py``): save a model, install a profile's
fakes, build with the real backend code, and read what the fake builder chose."""

import onnx

from agent.engines.backends import tensorrt as trt_backend
from tests import fake_trt
from tests.models import fp16_max_model


def save(model, tmp_path, name="m.onnx"):
    path = str(tmp_path / name)
    onnx.save(model, path)
    return path


def build(monkeypatch, tmp_path, profile, plan, model=None, numpy_version=None,
          num_dla_cores=0, engine="e.engine"):
    """(backend, build result, fake trt, fake cuda) of one build under ``profile``."""
    trt, cuda = fake_trt.install(monkeypatch, profile, numpy_version, num_dla_cores)
    path = save(model if model is not None else fp16_max_model(), tmp_path)
    backend = trt_backend.TensorRTBackend(trt.__version__)
    result = backend.build(path, plan, str(tmp_path / engine))
    return backend, result, trt, cuda


def engine_precisions(trt):
    return {layer["name"]: layer["precision"] for layer in trt._driver.builds[-1]["layers"]}
