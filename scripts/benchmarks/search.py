"""Precision search on a real topology: ``minimal`` vs Polygraphy's ``bisect`` and ``linear``.

The model is DenseNet-121 from the onnx package's backend test data (``light_densenet121``:
the real graph with its weights stripped; ResNet-50 if DenseNet is missing), given random
weights (He-initialised convolutions, batch norms near identity) and a 32x32 input so that a
build-and-run takes well under a second on a CPU. Three amplify/attenuate Mul pairs are planted
after ReLUs at 1/4, 1/2 and 3/4 of the depth (k = 6 planted layers that must stay fp32: the
amplify pushes values past the fp16 range, the attenuate brings them back). Every mode runs
the same fp16 search (host backend, emulated fp16) against fp32 goldens with its own empty
engine cache, side by side in one process. ``linear`` is capped (``LINEAR_CAP`` builds): it
needs one build per layer up to the deepest culprit, hundreds here. ``minimal`` also runs
without its ranking (``instrument=False``: topological order, no instrumented builds), with
its default budget (2x bisect's evaluations + 4: no more layers than bisect) and with a
budget of 200 (the group-testing bound k*log2(N)+2k plus the bisect-bounded phase).
"""

import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import onnx
from onnx import numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from agent.engines.backends import layer_precisions, onnx_model  # noqa: E402
from agent.engines.backends.base import BuildPlan  # noqa: E402
from agent.engines.backends.onnxruntime import create  # noqa: E402
from agent.engines.cache import EngineCache  # noqa: E402
from agent.precision import golden  # noqa: E402
from agent.precision.searcher import run_search  # noqa: E402
from tests.planted import plant_amplify_pairs  # noqa: E402

SIZE = 32  # input height/width
SITES = (0.25, 0.5, 0.75)  # depth fractions of the planted pairs
LINEAR_CAP = 25
# Median check (as in the seeds); fp16 everywhere else moves the logits' median error
# by ~1e-3 here, an overflow by inf.
TOLERANCES = {"atol": 1e-2, "rtol": 1e-2, "check_error_stat": "median"}
HOST = {"kind": "host"}


def light_model_path(name):
    base = os.path.dirname(onnx.__file__)
    path = os.path.join(base, "backend", "test", "data", "light", "light_{}.onnx".format(name))
    return path if os.path.isfile(path) else None


def materialize(model, seed=0, size=SIZE):
    """Give a weight-stripped "light" model random weights and a small input: ConstantOfShape
    weight generators become initializers (by role: conv weights He-normal, batch-norm
    scale/var near 1, shifts near 0), Unsqueeze of a weight is folded, fixed 7x7 average
    pools become global ones, and the input is resized to ``size``."""
    rng = np.random.RandomState(seed)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    readers = {}
    for node in g.node:
        for k, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, k))

    def role_of(tensor):
        node, k = readers[tensor][0]
        if node.op_type == "Unsqueeze":
            return role_of(node.output[0])
        return node.op_type, k

    def weight(shape, role):
        op, k = role
        if op == "Conv" and k == 1:
            fan_in = int(np.prod(shape[1:]))
            return rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)
        if op == "Gemm" and k == 1:
            return rng.standard_normal(shape) / np.sqrt(shape[-1])
        if (op == "BatchNormalization" and k in (1, 4)) or op == "Mul":
            return 1.0 + 0.1 * rng.random_sample(shape)
        return 0.05 * rng.standard_normal(shape)

    new_inits, nodes = [], []
    folded = {}
    for node in g.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in inits:
            shape = [int(d) for d in numpy_helper.to_array(inits[node.input[0]])]
            value = weight(shape, role_of(node.output[0])).astype(np.float32)
            folded[node.output[0]] = value
            continue
        if node.op_type == "Unsqueeze" and node.input[0] in folded:
            axes = [a for a in node.attribute if a.name == "axes"][0].ints
            value = folded[node.input[0]]
            for axis in sorted(axes):
                value = np.expand_dims(value, axis)
            folded[node.output[0]] = value
            continue
        if node.op_type == "AveragePool" and list(
                [a for a in node.attribute if a.name == "kernel_shape"][0].ints) == [7, 7]:
            node = onnx.helper.make_node("GlobalAveragePool", list(node.input),
                                         list(node.output), name=node.name)
        nodes.append(node)
    used = set(i for n in nodes for i in n.input)
    for name, value in folded.items():
        if name in used:
            new_inits.append(numpy_helper.from_array(value, name))
    kept = [i for i in g.initializer if i.name in used]
    del g.node[:]
    g.node.extend(nodes)
    del g.initializer[:]
    g.initializer.extend(kept + new_inits)
    del g.value_info[:]
    # Old IR versions list initializers as graph inputs too: keep only the real input.
    real = [vi for vi in g.input if vi.name not in inits and vi.name not in folded]
    del g.input[:]
    g.input.extend(real)
    model.ir_version = max(model.ir_version, 4)
    dims = g.input[0].type.tensor_type.shape.dim
    dims[2].dim_value = size
    dims[3].dim_value = size
    onnx_model.ensure_node_names(model)
    onnx.checker.check_model(model)
    return model


def plant(model, path, backend, work):
    """Plant the pairs after ReLUs at SITES of the depth, each amplifying the ReLU's largest
    reference value to 4x the fp16 maximum."""
    relus = [n.name for n in model.graph.node if n.op_type == "Relu"]
    sites = [relus[int(f * len(relus))] for f in SITES]
    onnx.save(model, path)
    inputs = golden.generate_inputs(onnx_model.input_specs(model))
    plan = BuildPlan("fp32", mark_outputs=sites)
    res = backend.build(path, plan, os.path.join(work, "probe.onnx"))
    with backend.open(res.engine_path) as runner:
        values = runner.infer(inputs[0])
    by_node = {n.name: n.output[0] for n in model.graph.node}
    factors = [4.0 * 65504.0 / float(np.max(np.abs(values[by_node[s]]))) for s in sites]
    planted, culprits = plant_amplify_pairs(model, sites, factors)
    onnx.save(planted, path)
    return culprits, inputs


def search(path, mode, inputs, goldens, backend, work, cap=None, instrument=True):
    cache_dir = os.path.join(work, "cache-{}-{}".format(mode, instrument))
    shutil.rmtree(cache_dir, ignore_errors=True)
    started = time.monotonic()
    result = run_search(path, BuildPlan("fp16"), inputs, goldens, backend,
                        EngineCache(cache_dir), HOST, mode=mode, compare_options=TOLERANCES,
                        max_evaluations=cap, instrument=instrument)
    return result, time.monotonic() - started


def run():
    name = "densenet121" if light_model_path("densenet121") else "resnet50"
    source = light_model_path(name)
    if source is None:
        return [{"name": "search (no onnx backend test models installed)", "ours": None,
                 "baseline": None, "unit": "", "goal": "skipped"}]
    work = tempfile.mkdtemp(prefix="bench-search-")
    try:
        backend = create()
        path = os.path.join(work, name + ".onnx")
        model = materialize(onnx.load(source))
        culprits, inputs = plant(model, path, backend, work)
        goldens = golden.reference_outputs(path, inputs, backend)
        n = len(layer_precisions.float_nodes(onnx_model.load_model(path)))
        k = len(culprits)
        budget = k * math.log2(n) + 2 * k
        found = {}
        for label, mode, cap, instrument in (
                ("minimal", "minimal", None, True), ("bisect", "bisect", None, True),
                ("linear", "linear", LINEAR_CAP, True),
                ("unranked", "minimal", None, False),
                ("unranked200", "minimal", 200, False)):
            found[label] = search(path, mode, inputs, goldens, backend, work, cap, instrument)
            r, seconds = found[label]
            print("  {:<8} {:>3} evaluations, {:>3} layers kept, {:6.1f} s{}{}".format(
                label, r.evaluations, len(r.keep), seconds,
                "" if r.complete else " (stopped at the cap: no passing prefix yet)",
                "  exact" if sorted(r.keep) == sorted(culprits) else ""), file=sys.stderr)
        (mini, mini_s), (bis, bis_s), (lin, lin_s) = (found["minimal"], found["bisect"],
                                                      found["linear"])
        unranked, unranked_s = found["unranked"]
        wide, wide_s = found["unranked200"]
        bound = 2 * bis.evaluations + 4
        model_desc = "{} ({} candidate layers, k={})".format(name, n, k)
        rows = [
            {"name": "evaluations: minimal vs bisect, " + model_desc,
             "ours": mini.evaluations, "baseline": bis.evaluations, "unit": "builds",
             "goal": "minimal <= 2x bisect + 4 = {} (or more while still shrinking fast): "
                     "{}".format(bound, "met" if mini.evaluations <= bound or (
                         mini.budget_extended and mini.layers_kept < bis.layers_kept)
                         else "MISSED")},
            {"name": "layers kept: minimal vs bisect", "ours": len(mini.keep),
             "baseline": len(bis.keep), "unit": "layers",
             "goal": "minimal == the {} planted ({})".format(
                 k, "yes" if sorted(mini.keep) == sorted(culprits) else "NO")},
            {"name": "wall time: minimal vs bisect", "ours": round(mini_s, 2),
             "baseline": round(bis_s, 2), "unit": "s",
             "goal": "incl. 2 instrumented builds for minimal"},
            {"name": "evaluations: minimal vs linear (capped at {})".format(LINEAR_CAP),
             "ours": mini.evaluations, "baseline": lin.evaluations, "unit": "builds",
             "goal": "linear {}".format("done" if lin.complete else
                                        "not done at the cap: needs one build per layer")},
            {"name": "layers kept: minimal vs linear", "ours": len(mini.keep),
             "baseline": len(lin.keep) if lin.complete else None, "unit": "layers",
             "goal": "" if lin.complete else "linear found no passing prefix within the cap"},
            {"name": "wall time: minimal vs linear (capped)", "ours": round(mini_s, 2),
             "baseline": round(lin_s, 2), "unit": "s", "goal": ""},
            {"name": "evaluations: minimal without ranking (--no-instrument) vs bisect",
             "ours": unranked.evaluations, "baseline": bis.evaluations, "unit": "builds",
             "goal": "<= 2x bisect + 4 = {}: {}; kept {} vs bisect's {} ({})".format(
                 bound, "met" if unranked.evaluations <= bound else "MISSED",
                 len(unranked.keep), len(bis.keep),
                 "<= bisect" if len(unranked.keep) <= len(bis.keep) else "MORE than bisect")},
            {"name": "evaluations: minimal without ranking, --max-evaluations 200",
             "ours": wide.evaluations, "baseline": bis.evaluations, "unit": "builds",
             "goal": "<= k*log2(N)+2k+2log2(N)+5 = {:.0f}; kept {} ({})".format(
                 budget + 2 * math.log2(n) + 5, len(wide.keep),
                 "exact" if sorted(wide.keep) == sorted(culprits) else "NOT exact")},
            {"name": "wall time: minimal without ranking vs bisect",
             "ours": round(unranked_s, 2), "baseline": round(bis_s, 2), "unit": "s",
             "goal": ""},
            {"name": "wall time: minimal without ranking, budget 200, vs bisect",
             "ours": round(wide_s, 2), "baseline": round(bis_s, 2), "unit": "s", "goal": ""},
        ]
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    for row in run():
        print(row)
