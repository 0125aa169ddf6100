"""Real Q/DQ (explicitly quantized) models for tests, made in the test from a model shipped in
a wheel: rapidocr-onnxruntime's PP-OCR text-direction classifier (585 KB, 53 Conv, opset 11;
``requirements-models.txt``), its input fixed at 1x3x48x192, quantized by the two tools users
run:

- onnxruntime's ``quantize_static(..., QuantFormat.QDQ)``: symmetric int8, every Conv / MatMul
  between pairs (``quantization`` says ``explicit``);
- NVIDIA TensorRT Model Optimizer's ONNX PTQ (``modelopt.onnx.quantization.quantize``, int8,
  max calibration on the CPU provider): it leaves the convolutions TensorRT cannot run in int8
  in float (``mixed``). ``nvidia-modelopt[onnx]`` pins onnx ~= 1.21, onnxruntime-gpu ~= 1.24
  and pulls torch (750 MB installed), so the suite does not install it: it reads the model
  ModelOpt 0.47.0 made with ``modelopt_qdq`` below, kept in
  ``tests/fixtures/qdq/cls_modelopt.onnx.gz`` (``python -m tests.qdq_models`` makes it again).
  Where ModelOpt is importable (``pip install --no-deps -r requirements-modelopt.txt``, the CPU
  torch wheel included), a test checks that it still makes the same graph.

Calibration data is random (two samples): what matters here is the graph the tools write.
"""

import gzip
import importlib.util
import logging
import os
import shutil
import tempfile

import numpy as np
import onnx
import pytest

SOURCE = ("rapidocr_onnxruntime", "models/ch_ppocr_mobile_v2.0_cls_infer.onnx")
INPUT = "x"
SHAPE = (1, 3, 48, 192)
MODELOPT_MISSING = ("nvidia-modelopt's ONNX PTQ is not importable (pip install --no-deps "
                    "nvidia-modelopt with its CPU dependencies: requirements-modelopt.txt)")


def source_model(dst):
    """The wheel's classifier with a fixed input shape, saved at ``dst``; skips without it."""
    spec = importlib.util.find_spec(SOURCE[0])
    path = os.path.join(list(spec.submodule_search_locations)[0], SOURCE[1]) if spec else ""
    if not os.path.isfile(path):
        pytest.skip("{} is not installed (requirements-models.txt)".format(SOURCE[0]))
    model = onnx.load(path)
    for dim, size in zip(model.graph.input[0].type.tensor_type.shape.dim, SHAPE):
        dim.ClearField("dim_param")
        dim.dim_value = size
    onnx.save(model, str(dst))
    return str(dst)


def feeds(count=2, seed=0):
    rng = np.random.RandomState(seed)
    return [{INPUT: rng.rand(*SHAPE).astype(np.float32)} for _ in range(count)]


def onnxruntime_qdq(src, dst):
    """onnxruntime's QDQ quantizer (symmetric int8 activations and weights)."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter(feeds())

        def get_next(self):
            return next(self.feeds, None)

    quantize_static(str(src), str(dst), Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                    extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
    return str(dst)


MODELOPT_FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "qdq",
                                "cls_modelopt.onnx.gz")


def modelopt_fixture(dst):
    """The model ``modelopt_qdq`` made (ModelOpt 0.47.0, module notes), written at ``dst``."""
    with gzip.open(MODELOPT_FIXTURE, "rb") as src, open(str(dst), "wb") as out:
        shutil.copyfileobj(src, out)
    return str(dst)


def modelopt_qdq(src, dst):
    """ModelOpt's ONNX PTQ, int8, max calibration on the CPU; skips when not importable."""
    try:
        from modelopt.onnx.quantization import quantize
    except ImportError as exc:
        pytest.skip("{}: {}".format(MODELOPT_MISSING, str(exc).splitlines()[0]))
    logging.getLogger("modelopt").setLevel(logging.WARNING)
    data = np.concatenate([f[INPUT] for f in feeds()])
    quantize(str(src), quantize_mode="int8", calibration_data={INPUT: data},
             calibration_method="max", calibration_eps=["cpu"], high_precision_dtype="fp32",
             output_path=str(dst))
    return str(dst)


if __name__ == "__main__":  # make the ModelOpt fixture again (ModelOpt importable)
    with tempfile.TemporaryDirectory() as tmp:
        made = modelopt_qdq(source_model(os.path.join(tmp, "cls.onnx")),
                            os.path.join(tmp, "cls_modelopt.onnx"))
        with open(made, "rb") as src, gzip.open(MODELOPT_FIXTURE, "wb", 9) as out:
            shutil.copyfileobj(src, out)
    print(MODELOPT_FIXTURE)
