"""Real ONNX models for tests and benchmarks, built with onnx.helper (no files needed).

- ``fp16_max_model``: the seeds' "Adding Precision Constraints" model: flip, +FP16_MAX,
  -FP16_MAX, flip. In fp16 the Add overflows for positive x; keeping Add and Sub in fp32 fixes it.
- ``digits_classifier``: an MLP trained on scikit-learn's real digits data (8x8 images),
  exported as Gemm/Relu layers; for INT8 accuracy checks.
"""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FP16_MAX = float(np.finfo(np.float16).max)
OPSET = 17


def save(model, path):
    onnx.save(model, str(path))
    return str(path)


def fp16_max_model(n=4):
    """x: float32[1,1,n,n] -> y. Node names: MatMul_0, Add, Sub, MatMul_1."""
    flip = np.rot90(np.identity(n, dtype=np.float32)).copy()
    inits = [
        numpy_helper.from_array(flip, "flip"),
        numpy_helper.from_array(np.array(FP16_MAX, dtype=np.float32), "fp16_max"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "flip"], ["flipped"], name="MatMul_0"),
        helper.make_node("Add", ["flipped", "fp16_max"], ["added"], name="Add"),
        helper.make_node("Sub", ["added", "fp16_max"], ["subbed"], name="Sub"),
        helper.make_node("MatMul", ["subbed", "flip"], ["y"], name="MatMul_1"),
    ]
    graph = helper.make_graph(
        nodes, "needs_constraints",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, n, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, n, n])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    onnx.checker.check_model(model)
    return model


def load_digits_split(seed=0):
    """scikit-learn's digits (1797 real 8x8 images), scaled to [0, 1], split 70/30."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.RandomState(seed).permutation(len(x))
    x, y = x[order], y[order]
    cut = int(0.7 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def digits_classifier(hidden=(64, 32), seed=0, batch=None):
    """Train an MLP on digits and export it. Returns (model, (x_train, y_train, x_test, y_test)).

    Input "input": float32[batch, 64] (batch None = dynamic "N"); output "logits": [batch, 10].
    Node names: fc0, relu0, fc1, relu1, ..., fc_out.
    """
    from sklearn.neural_network import MLPClassifier

    split = load_digits_split(seed)
    x_train, y_train = split[0], split[1]
    clf = MLPClassifier(hidden_layer_sizes=hidden, max_iter=400, random_state=seed)
    clf.fit(x_train, y_train)
    nodes, inits = [], []
    prev = "input"
    layers = len(clf.coefs_)
    for i, (w, b) in enumerate(zip(clf.coefs_, clf.intercepts_)):
        last = i == layers - 1
        name = "fc_out" if last else "fc{}".format(i)
        inits += [numpy_helper.from_array(w.astype(np.float32), name + ".weight"),
                  numpy_helper.from_array(b.astype(np.float32), name + ".bias")]
        out = "logits" if last else name + ".out"
        nodes.append(helper.make_node("Gemm", [prev, name + ".weight", name + ".bias"], [out],
                                      name=name))
        prev = out
        if not last:
            nodes.append(helper.make_node("Relu", [out], ["relu{}.out".format(i)],
                                          name="relu{}".format(i)))
            prev = "relu{}.out".format(i)
    dim = batch if batch is not None else "N"
    graph = helper.make_graph(
        nodes, "digits_mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [dim, 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [dim, 10])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    onnx.checker.check_model(model)
    return model, split


def efficientnms_detector(path):
    """A real detector with TensorRT's ``EfficientNMS_TRT`` plugin on its outputs, as YOLO and
    TAO exports ship it, written with onnx-graphsurgeon: ddddocr's character detector
    (``common_det.onnx`` in its wheel, output [1, 3549, 6]: cx, cy, w, h, objectness, class)
    split into boxes [1, 3549, 4] and scores [1, 3549, 1] (objectness x class) feeding the
    plugin node. Saved at ``path``; None when ddddocr or onnx-graphsurgeon is missing."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("ddddocr")
    gs_spec = importlib.util.find_spec("onnx_graphsurgeon")
    if spec is None or gs_spec is None or not spec.submodule_search_locations:
        return None
    source = os.path.join(list(spec.submodule_search_locations)[0], "common_det.onnx")
    if not os.path.isfile(source):
        return None
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(onnx.load(source))
    out = graph.outputs[0]

    def piece(name, start, end):
        t = gs.Variable(name, np.float32, [1, 3549, end - start])
        graph.nodes.append(gs.Node("Slice", name="slice_" + name, inputs=[
            out, gs.Constant(name + "_s", np.array([start], np.int64)),
            gs.Constant(name + "_e", np.array([end], np.int64)),
            gs.Constant(name + "_a", np.array([2], np.int64))], outputs=[t]))
        return t

    boxes, objectness, cls = piece("boxes", 0, 4), piece("obj", 4, 5), piece("cls", 5, 6)
    scores = gs.Variable("scores", np.float32, [1, 3549, 1])
    graph.nodes.append(gs.Node("Mul", name="score_mul", inputs=[objectness, cls],
                               outputs=[scores]))
    outputs = [gs.Variable("num_detections", np.int32, [1, 1]),
               gs.Variable("detection_boxes", np.float32, [1, 100, 4]),
               gs.Variable("detection_scores", np.float32, [1, 100]),
               gs.Variable("detection_classes", np.int32, [1, 100])]
    graph.nodes.append(gs.Node("EfficientNMS_TRT", name="nms", inputs=[boxes, scores],
                               outputs=outputs, attrs={
                                   "plugin_version": "1", "background_class": -1,
                                   "max_output_boxes": 100, "score_threshold": 0.25,
                                   "iou_threshold": 0.45, "score_activation": 0,
                                   "box_coding": 1}))
    graph.outputs = outputs
    graph.cleanup().toposort()
    onnx.save(gs.export_onnx(graph), str(path))
    return str(path)
