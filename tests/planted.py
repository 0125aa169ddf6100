"""Models with planted precision-sensitive layers, built with onnx.helper, for precision searches.

Each builder returns ``(model, culprits)``: the node names that must stay in float32 for the
reduced-precision build to match the fp32 goldens, and nothing else does.

- ``fp16_chain``: a deep chain of MatMul/Add/Relu blocks with amplify/attenuate Mul pairs at
  several non-adjacent depths. The amplify multiplies past the fp16 range and the attenuate
  brings the values back, so the fp32 result is ordinary; in fp16 either node overflows to inf
  (the amplify's output, or the attenuate's input when it reads an fp32 tensor), so both nodes
  of every pair must stay fp32 and nothing else needs to.
- ``int8_outlier_chain``: a chain of MatMul/Relu layers where, at some depths, one channel of a
  MatMul's input is scaled by a large factor (and its weight row by the inverse, so the fp32
  result is unchanged). With a per-tensor activation scale that outlier channel crushes every
  other channel to zero in int8, and the inverse-scaled weight row vanishes in per-channel
  weight quantization: that MatMul must stay fp32.
- ``plant_amplify_pairs``: the same amplify/attenuate pairs planted into any model after the
  named nodes (the benchmark plants them into a real topology).
"""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.models import OPSET

AMPLIFY = 2.0e5  # x * AMPLIFY > 65504 (fp16 max) for x > 0.33


def _model(nodes, inits, name, inputs, outputs):
    graph = helper.make_graph(nodes, name, inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    onnx.checker.check_model(model)
    return model


def fp16_chain(blocks=14, width=8, sites=(2, 6, 11), amplify=AMPLIFY, seed=0, batch=4):
    """x: float32[batch, width] in [0, 1] -> y. Nodes per block i: mm<i>, bias<i>, relu<i>;
    at each block in ``sites`` also amp<i>, att<i> (the culprits) after relu<i>."""
    rng = np.random.RandomState(seed)
    nodes, inits, culprits = [], [], []
    prev = "x"
    for i in range(blocks):
        # Near-identity weights keep the activations O(1) through the depth.
        w = (np.eye(width) + 0.1 * rng.standard_normal((width, width))).astype(np.float32)
        b = (0.05 * rng.standard_normal(width)).astype(np.float32)
        inits += [numpy_helper.from_array(w, "w{}".format(i)),
                  numpy_helper.from_array(b, "b{}".format(i))]
        nodes += [
            helper.make_node("MatMul", [prev, "w{}".format(i)], ["mm{}.out".format(i)],
                             name="mm{}".format(i)),
            helper.make_node("Add", ["mm{}.out".format(i), "b{}".format(i)],
                             ["bias{}.out".format(i)], name="bias{}".format(i)),
            helper.make_node("Relu", ["bias{}.out".format(i)], ["relu{}.out".format(i)],
                             name="relu{}".format(i)),
        ]
        prev = "relu{}.out".format(i)
        if i in sites:
            inits += [numpy_helper.from_array(np.array(amplify, np.float32), "up{}".format(i)),
                      numpy_helper.from_array(np.array(1.0 / amplify, np.float32),
                                              "down{}".format(i))]
            nodes += [
                helper.make_node("Mul", [prev, "up{}".format(i)], ["amp{}.out".format(i)],
                                 name="amp{}".format(i)),
                helper.make_node("Mul", ["amp{}.out".format(i), "down{}".format(i)],
                                 ["att{}.out".format(i)], name="att{}".format(i)),
            ]
            culprits += ["amp{}".format(i), "att{}".format(i)]
            prev = "att{}.out".format(i)
    nodes.append(helper.make_node("Identity", [prev], ["y"], name="out"))
    model = _model(nodes, inits, "fp16_chain",
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, width])])
    return model, culprits


def int8_outlier_chain(layers=10, width=16, sites=(3, 7), outlier=1000.0, seed=0):
    """x: float32[N, width] in [0, 1] -> y. Nodes: mm<i> (MatMul), relu<i>; at each layer in
    ``sites`` a Mul spike<i> scales one input channel of mm<i> by ``outlier`` (mm<i> is the
    culprit; the Mul itself has no int8 kernel and stays fp32)."""
    rng = np.random.RandomState(seed)
    nodes, inits, culprits = [], [], []
    prev = "x"
    for i in range(layers):
        w = (np.eye(width) + 0.1 * rng.standard_normal((width, width))).astype(np.float32)
        if i in sites:
            channel = int(rng.randint(width))
            scale = np.ones(width, np.float32)
            scale[channel] = outlier
            w[channel, :] /= outlier
            inits.append(numpy_helper.from_array(scale, "spike{}.scale".format(i)))
            nodes.append(helper.make_node("Mul", [prev, "spike{}.scale".format(i)],
                                          ["spike{}.out".format(i)], name="spike{}".format(i)))
            prev = "spike{}.out".format(i)
            culprits.append("mm{}".format(i))
        inits.append(numpy_helper.from_array(w, "w{}".format(i)))
        nodes.append(helper.make_node("MatMul", [prev, "w{}".format(i)], ["mm{}.out".format(i)],
                                      name="mm{}".format(i)))
        nodes.append(helper.make_node("Relu", ["mm{}.out".format(i)],
                                      ["relu{}.out".format(i)], name="relu{}".format(i)))
        prev = "relu{}.out".format(i)
    nodes.append(helper.make_node("Identity", [prev], ["y"], name="out"))
    model = _model(nodes, inits, "int8_outlier_chain",
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])])
    return model, culprits


def plant_amplify_pairs(model, after, amplify=AMPLIFY):
    """Insert an amplify/attenuate Mul pair (amp<j>, att<j>) after the first output of each
    node named in ``after``, rewiring its readers; ``amplify`` is one factor or one per node.
    Returns (new model, culprits)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    nodes = list(graph.node)
    culprits = []
    factors = list(amplify) if isinstance(amplify, (list, tuple)) else [amplify] * len(after)
    for j, name in enumerate(after):
        amplify = factors[j]
        at = [i for i, n in enumerate(nodes) if n.name == name]
        if not at:
            raise ValueError("no node named {!r}".format(name))
        src = nodes[at[0]].output[0]
        amp, att = "amp{}".format(j), "att{}".format(j)
        graph.initializer.extend([
            numpy_helper.from_array(np.array(amplify, np.float32), amp + ".k"),
            numpy_helper.from_array(np.array(1.0 / amplify, np.float32), att + ".k")])
        for n in nodes[at[0] + 1:]:
            for i, inp in enumerate(n.input):
                if inp == src:
                    n.input[i] = att + ".out"
        for out in graph.output:
            if out.name == src:
                raise ValueError("cannot plant after a node whose output is a graph output")
        nodes[at[0] + 1:at[0] + 1] = [
            helper.make_node("Mul", [src, amp + ".k"], [amp + ".out"], name=amp),
            helper.make_node("Mul", [amp + ".out", att + ".k"], [att + ".out"], name=att),
        ]
        culprits += [amp, att]
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    return model, culprits
