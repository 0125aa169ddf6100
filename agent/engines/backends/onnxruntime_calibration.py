"""Calibration on the host: the fp32 model with every float tensor marked as an output, run over
the streamed dataset on ONNX Runtime, feeding ``calib.ranges.RangeCollector``. A dynamic batch
is fed in slices whose activations stay under ``RUN_BYTES``, so the peak memory does not grow
with the calibration batch size. Worker side: Python >= 3.6.
"""

from typing import Dict, List, Optional

import numpy as np
import onnx

from agent.engines.backends.base import Progress, TensorSpec, no_progress
from agent.engines.backends.onnx_model import mark_outputs
from agent.engines.backends.onnxruntime_runner import open_session
from calib.dataset import CalibrationDataset
from calib.ranges import RangeCollector

# Calibration runs return every float tensor at once: a dynamic batch is fed in slices whose
# activations stay under this (one sample at least).
RUN_BYTES = 256 << 20


def calibrate(
    model: onnx.ModelProto,
    dataset: CalibrationDataset,
    algorithm: str,
    progress: Progress = no_progress,
    threads: Optional[int] = None,
    num_bins: int = 2048,
) -> Dict[str, float]:
    """amax of every float graph input and node output of the fp32 ``model`` over the
    dataset, per ``algorithm`` (entropy2 / minmax / percentile / legacy)."""
    instrumented = mark_outputs(model, ["*"])
    data = instrumented.SerializeToString()
    del instrumented
    # Every float tensor of a run comes back at once: without the arena, what one run
    # allocated is returned before the next, so the peak is one run's activations (plus the
    # histograms), whatever the number of images.
    session = open_session(data, threads, "calibration model", arena=False)
    del data
    float_names = [o.name for o in session.get_outputs() if o.type in
                   ("tensor(float)", "tensor(float16)", "tensor(double)")]
    float_inputs = [i.name for i in session.get_inputs() if i.type in
                    ("tensor(float)", "tensor(float16)", "tensor(double)")]
    # Inputs whose batch dimension is free are fed in slices whose activations fit
    # RUN_BYTES (measured on the first sample): the histograms add up the same, and the peak
    # no longer grows with the calibration batch size.
    dynamic = all(i.shape and not isinstance(i.shape[0], int) for i in session.get_inputs())
    collector = RangeCollector(algorithm, num_bins=num_bins)
    total = dataset.num_batches()
    progress("calibrating", 0, total)
    done = 0
    step: Optional[int] = None if dynamic else 0
    for batch in dataset:
        size = min((len(v) for v in batch.values() if np.ndim(v)), default=1)
        start = 0
        while start < size or (start == 0 and size == 0):
            if step is None:
                count = 1  # the first sample alone: its activations size the slices
            else:
                count = step or size
            part = batch if count >= size and start == 0 else \
                {k: v[start:start + count] for k, v in batch.items()}
            values = session.run(float_names, part)
            if step is None:
                per_sample = sum(int(getattr(v, "nbytes", 0)) for v in values)
                step = max(1, RUN_BYTES // max(1, per_sample))
            for name in float_inputs:
                collector.update(name, part[name])
            for index, name in enumerate(float_names):
                collector.update(name, values[index])
                values[index] = None  # free each tensor once counted
            del values
            start += max(count, 1)
        done += 1
        progress("calibrating", done, total)
    progress("calibrating", total, total)
    return collector.amax()


def calibration_batch_size(specs: List[TensorSpec], requested: int) -> int:
    """The batch size a model can take: its fixed batch dimension, else the requested one."""
    for spec in specs:
        if spec.shape and spec.shape[0] is not None:
            return int(spec.shape[0])
    return int(requested)
