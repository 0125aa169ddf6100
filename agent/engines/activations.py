"""An ONNX model's intermediate tensors on given inputs (ONNX Runtime, CPU): what the field's
INT8 range watch (``agent.precision.live``) compares with a calibration cache's ranges. The
tensors are marked as extra outputs of a copy of the model; the arena is off, so the memory of
an instrumented run goes back after it."""

from typing import Dict, Optional, Sequence

import numpy as np

from agent.engines.backends.onnx_model import load_model, mark_outputs
from agent.engines.backends.onnxruntime_runner import OnnxRuntimeRunner, open_session


class Activations(object):
    """``run(feeds)`` -> tensor -> array for the ``tensors`` the model holds (graph inputs come
    from the feeds; names the model does not hold are left out, listed in ``missing``)."""

    def __init__(self, onnx_path: str, tensors: Sequence[str],
                 threads: Optional[int] = None) -> None:
        model = load_model(onnx_path)
        produced = {o for n in model.graph.node for o in n.output if o}
        self.inputs = [t for t in tensors if t in {i.name for i in model.graph.input}]
        marked = [t for t in tensors if t in produced]
        self.missing = [t for t in tensors if t not in produced and t not in self.inputs]
        model = mark_outputs(model, marked)
        self.runner = OnnxRuntimeRunner(open_session(model.SerializeToString(), threads,
                                                     onnx_path, arena=False))
        self.tensors = marked

    def run(self, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        out = self.runner.infer(feeds)
        found = {t: out[t] for t in self.tensors if t in out}
        found.update({t: np.asarray(feeds[t]) for t in self.inputs})
        return found

    def close(self) -> None:
        self.runner.close()
