"""Golden inputs and outputs: Polygraphy's files, generated inputs, checks against the model.

- Inputs (``polygraphy run --save-inputs``): a JSON list with one ``{input name: array}`` dict
  per iteration. Outputs (``--save-outputs``): a ``RunResults`` JSON,
  ``{"lst": [[runner name, [IterationResult, ...]]], "polygraphy_class": "RunResults"}``, each
  IterationResult ``{"outputs": {name: {"values": array, "polygraphy_class": "LazyArray"}},
  "runtime": s, "runner_name": name, "polygraphy_class": "IterationResult"}``. Either may be an
  .npz instead. How arrays are encoded in these files (and in older Polygraphy files), and the
  caps on what they inflate to, live in ``golden_codec``.
- Generated inputs (``--val-range``, ``--seed``, ``--iterations``) follow Polygraphy's
  DataLoader: iteration i draws from ``numpy.random.RandomState(seed + i)``, inputs in model
  order, floats ``random_sample * (hi - lo) + lo``, integers ``randint(lo, hi + 1)``; default
  range [0, 1], seed 1, dynamic dimensions 1.
- Goldens from inputs alone are computed with the fp32 host backend (ONNX Runtime).

Everything the model disagrees with raises ``golden_mismatch`` saying what was expected and
what was found; files that cannot be parsed raise ``bad_golden_file``. Worker side: Python 3.6.
"""

import json
import math
import os
import re
import shutil
import tempfile
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from agent.engines import safe_npz
from agent.engines.backends.base import Backend, BuildPlan, TensorSpec
from agent.errors import AgentError
from agent.fsio import atomic_write
from agent.precision.golden_codec import (
    TYPE_MARKER,
    Feed,
    as_feed,
    encode_array,
    is_npz,
    load_npz,
    must_exist,
    read_json,
    save_npz,
    type_of,
)

DEFAULT_SEED = 1  # Polygraphy's constants.DEFAULT_SEED
DEFAULT_RANGE = (0.0, 1.0)
DEFAULT_RUNNER = "onnxrt-runner"


def load_inputs(path: str) -> List[Feed]:
    """Inputs per iteration from a Polygraphy ``--save-inputs`` JSON or an .npz."""
    must_exist(path, "inputs file")
    if is_npz(path):
        return load_npz(path)
    data = read_json(path, "inputs file")
    if isinstance(data, dict) and type_of(data) is None and all(
            isinstance(v, np.ndarray) for v in data.values()):
        data = [data]  # a single feed dict
    if not isinstance(data, list) or not data:
        raise AgentError("bad_golden_file", "{}: expected a list of feed dicts (polygraphy "
                         "--save-inputs), found {}".format(path, type(data).__name__))
    return [as_feed(d, "{} iteration {}".format(path, i)) for i, d in enumerate(data)]


def save_inputs(path: str, inputs: Sequence[Feed]) -> None:
    """Write inputs as Polygraphy ``--save-inputs`` JSON, or .npz by extension."""
    if path.endswith(".npz"):
        save_npz(path, inputs)
        return
    doc = [OrderedDict((name, encode_array(arr)) for name, arr in feed.items())
           for feed in inputs]
    atomic_write(path, json.dumps(doc, indent=4).encode("utf-8"))


def load_run_results(path: str) -> List[Tuple[str, List[Feed]]]:
    """(runner name, outputs per iteration) for every runner of a Polygraphy
    ``--save-outputs`` RunResults JSON; an .npz gives one runner named "npz"."""
    must_exist(path)
    if is_npz(path):
        return [("npz", load_npz(path))]
    data = read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("lst"), list):
        raise AgentError("bad_golden_file", "{}: expected Polygraphy RunResults JSON "
                         "({{\"lst\": [[runner, [iteration results]]]}}), found {}".format(
                             path, type(data).__name__ if not isinstance(data, dict)
                             else "keys {}".format(sorted(data))))
    runners: List[Tuple[str, List[Feed]]] = []
    for entry in data["lst"]:
        if not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[1], list):
            raise AgentError("bad_golden_file", "{}: expected [runner name, [iteration "
                             "results]] entries, found {}".format(path, type(entry).__name__))
        name, outputs = str(entry[0]), []
        for i, it in enumerate(entry[1]):
            what = "{} runner {} iteration {}".format(path, name, i)
            if not isinstance(it, dict) or "outputs" not in it:
                raise AgentError("bad_golden_file", "{}: expected an IterationResult with "
                                 "outputs".format(what))
            outputs.append(as_feed(it["outputs"], what))
        runners.append((name, outputs))
    if not runners or not runners[0][1]:
        raise AgentError("bad_golden_file", "{}: RunResults holds no iteration".format(path))
    return runners


def load_outputs(path: str, runner: Optional[str] = None) -> List[Feed]:
    """Golden outputs per iteration: the first runner of a RunResults JSON (or ``runner`` by
    name), or an .npz."""
    runners = load_run_results(path)
    if runner is None:
        return runners[0][1]
    for name, outputs in runners:
        if name == runner:
            return outputs
    raise AgentError("golden_mismatch", "{}: no runner {!r}; the file holds {}".format(
        path, runner, [name for name, _ in runners]))


def save_outputs(path: str, outputs: Sequence[Feed], runner: str = DEFAULT_RUNNER,
                 runtime: Optional[float] = None) -> None:
    """Write outputs as Polygraphy ``--save-outputs`` RunResults JSON, or .npz by extension."""
    if path.endswith(".npz"):
        save_npz(path, outputs)
        return
    iterations = []
    for feed in outputs:
        lazy = OrderedDict((name, OrderedDict([("values", encode_array(arr)),
                                               (TYPE_MARKER, "LazyArray")]))
                           for name, arr in feed.items())
        iterations.append(OrderedDict([("outputs", lazy), ("runtime", runtime),
                                       ("runner_name", runner),
                                       (TYPE_MARKER, "IterationResult")]))
    doc = OrderedDict([("lst", [[runner, iterations]]), (TYPE_MARKER, "RunResults")])
    atomic_write(path, json.dumps(doc, indent=4).encode("utf-8"))


# ---------------------------------------------------------------------------------------------
# generated inputs


# Tokens split on spaces except inside brackets, so "x:[1, 2]" is one range.
_RANGE_TOKEN = re.compile(r"[^\s\[]*\[[^\]]*\]?|\S+")
_RANGE = re.compile(r"^(?:(?P<name>.*):)?\[\s*(?P<lo>[^,\]]+?)\s*,\s*(?P<hi>[^,\]]+?)\s*\]$")


def parse_val_range(items: Optional[Sequence[str]]) -> Dict[str, Tuple[float, float]]:
    """Polygraphy's ``--val-range x:[1,2] [0,5]``: {input name or "" (every input): (lo, hi)}."""
    out: Dict[str, Tuple[float, float]] = {}
    for item in items or []:
        for token in _RANGE_TOKEN.findall(str(item)):
            m = _RANGE.match(token)
            if not m:
                raise AgentError("bad_argument", "--val-range expects NAME:[LOW,HIGH] or "
                                 "[LOW,HIGH], found {!r}".format(token))
            try:
                lo, hi = float(m.group("lo")), float(m.group("hi"))
            except ValueError:
                raise AgentError("bad_argument", "--val-range bounds must be numbers, found "
                                 "{!r}".format(token))
            if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
                raise AgentError("bad_argument", "--val-range expects finite LOW <= HIGH, "
                                 "found {!r}".format(token))
            out[m.group("name") or ""] = (lo, hi)
    return out


def check_tensor_size(name: str, shape: Sequence[Any], dtype: Any, code: str) -> None:
    """Refuse (``code``) a tensor the worker would have to allocate above
    ``limits.max_data_bytes`` before numpy tries (2^31-1 squared is not a MemoryError)."""
    count = 1
    for d in shape:
        count *= max(int(d), 0)
    nbytes = count * np.dtype(dtype).itemsize
    if nbytes > safe_npz.max_data_bytes():
        raise AgentError(code, "input {!r}: shape {} of {} is {:,} bytes; expected at most "
                         "{:,} (limits.max_data_bytes)".format(
                             name, [int(d) for d in shape], np.dtype(dtype), nbytes,
                             safe_npz.max_data_bytes()),
                         {"input": name, "bytes": nbytes, "limit_bytes": safe_npz.max_data_bytes()})


def _static(dim: Any) -> int:
    """Polygraphy generates data for dynamic dimensions with size 1."""
    return 1 if _is_dynamic(dim) else int(dim)


def generate_inputs(
    input_specs: Sequence[TensorSpec],
    val_range: Optional[Dict[str, Tuple[float, float]]] = None,
    seed: int = DEFAULT_SEED,
    iterations: int = 1,
    shapes: Optional[Dict[str, Sequence[int]]] = None,
) -> List[Feed]:
    """Synthetic inputs exactly as Polygraphy's DataLoader draws them."""
    val_range = dict(val_range or {})
    unknown = [n for n in val_range if n and n not in [s.name for s in input_specs]]
    if unknown:
        raise AgentError("bad_argument", "--val-range names input(s) {} the model does not "
                         "have; its inputs are {}".format(unknown,
                                                          [s.name for s in input_specs]))
    if int(iterations) < 1:
        raise AgentError("bad_argument", "--iterations must be >= 1, found {}".format(
            iterations))
    default = val_range.get("", DEFAULT_RANGE)
    for spec in input_specs:
        shape = (shapes or {}).get(spec.name) or [_static(d) for d in spec.shape]
        check_tensor_size(spec.name, shape, spec.dtype, "bad_argument")
    feeds: List[Feed] = []
    for index in range(int(iterations)):
        rng = np.random.RandomState(int(seed) + index)
        feed: Feed = OrderedDict()
        for spec in input_specs:
            shape = tuple((shapes or {}).get(spec.name) or [_static(d) for d in spec.shape])
            lo, hi = val_range.get(spec.name, default)
            dtype = spec.dtype
            if np.issubdtype(dtype, np.integer):
                buf = rng.randint(low=int(lo), high=int(hi) + 1, size=shape, dtype=dtype)
            elif np.issubdtype(dtype, np.bool_):
                buf = rng.randint(low=bool(lo), high=bool(hi) + 1, size=shape, dtype=np.bool_)
            else:
                buf = (rng.random_sample(size=shape) * (hi - lo) + lo).astype(dtype)
            feed[spec.name] = np.array(buf)
        feeds.append(feed)
    return feeds


# ---------------------------------------------------------------------------------------------
# validation against the model


def _is_dynamic(dim: Any) -> bool:
    return not isinstance(dim, int) or dim <= 0


def _shape_matches(shape: Tuple[int, ...], spec: TensorSpec) -> bool:
    if len(shape) != len(spec.shape):
        return False
    return all(_is_dynamic(d) or d == s for d, s in zip(spec.shape, shape))


def _fmt_spec(spec: TensorSpec) -> str:
    dims = ["?" if _is_dynamic(d) else str(d) for d in spec.shape]
    return "{} ({}{})".format(spec.dtype, ", ".join(dims), "," if len(dims) == 1 else "")


def validate_inputs(inputs: Sequence[Feed], specs: Sequence[TensorSpec]) -> None:
    """Every iteration feeds exactly the model's inputs with their dtypes and shapes."""
    if not inputs:
        raise AgentError("golden_mismatch", "expected at least one iteration of inputs, "
                         "found none")
    expected = [s.name for s in specs]
    for i, feed in enumerate(inputs):
        names = list(feed)
        if sorted(names) != sorted(expected):
            raise AgentError("golden_mismatch", "inputs iteration {}: expected input(s) {}, "
                             "found {}".format(i, expected, names),
                             {"expected": expected, "found": names})
        for spec in specs:
            arr = feed[spec.name]
            if arr.dtype != spec.dtype or not _shape_matches(arr.shape, spec):
                raise AgentError("golden_mismatch", "input {!r} iteration {}: expected {}, "
                                 "found {} {}".format(spec.name, i, _fmt_spec(spec), arr.dtype,
                                                      arr.shape))


def validate_goldens(goldens: Sequence[Feed], specs: Sequence[TensorSpec],
                     iterations: Optional[int] = None) -> None:
    """Golden outputs name model outputs with their dtypes and shapes, hold no NaN, and come
    in as many iterations as the inputs."""
    if not goldens:
        raise AgentError("golden_mismatch", "expected at least one iteration of golden "
                         "outputs, found none")
    if iterations is not None and len(goldens) != iterations:
        raise AgentError("golden_mismatch", "expected {} iteration(s) of golden outputs (one "
                         "per input iteration), found {}".format(iterations, len(goldens)))
    by_name = {s.name: s for s in specs}
    for i, feed in enumerate(goldens):
        if not feed:
            raise AgentError("golden_mismatch", "golden outputs iteration {} holds no output; "
                             "expected some of {}".format(i, sorted(by_name)))
        for name, arr in feed.items():
            spec = by_name.get(name)
            if spec is None:
                raise AgentError("golden_mismatch", "golden output {!r} is not an output of the "
                                 "model; expected one of {}".format(name, sorted(by_name)),
                                 {"expected": sorted(by_name), "found": sorted(feed)})
            if arr.dtype != spec.dtype or not _shape_matches(arr.shape, spec):
                raise AgentError("golden_mismatch", "golden output {!r} iteration {}: expected "
                                 "{}, found {} {}".format(name, i, _fmt_spec(spec), arr.dtype,
                                                          arr.shape))
            if np.issubdtype(arr.dtype, np.floating) and np.isnan(arr).any():
                count = int(np.isnan(arr).sum())
                raise AgentError("golden_mismatch", "golden output {!r} iteration {}: expected "
                                 "numbers, found {} NaN of {} values (NaN never compares "
                                 "equal)".format(name, i, count, arr.size))


# ---------------------------------------------------------------------------------------------
# computing goldens


def run_model(backend: Backend, model_path: str, plan: BuildPlan,
              inputs: Sequence[Feed]) -> List[Feed]:
    """Build ``model_path`` per ``plan`` into a temporary engine and run every iteration."""
    tmp = tempfile.mkdtemp(prefix="jetson-agent-golden-")
    try:
        result = backend.build(model_path, plan, os.path.join(tmp, "engine"))
        with backend.open(result.engine_path) as runner:
            return [runner.infer(dict(feed)) for feed in inputs]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def reference_outputs(model_path: str, inputs: Sequence[Feed],
                      backend: Optional[Backend] = None) -> List[Feed]:
    """Goldens computed in fp32 with the host backend (ONNX Runtime) unless one is given."""
    if backend is None:
        from agent.engines.backends.base import get_backend

        backend = get_backend("onnxruntime")
    return run_model(backend, model_path, BuildPlan("fp32"), inputs)


def prepare(
    model_path: str,
    input_specs: Sequence[TensorSpec],
    output_specs: Sequence[TensorSpec],
    load_inputs_path: Optional[str] = None,
    load_outputs_path: Optional[str] = None,
    val_range: Optional[Dict[str, Tuple[float, float]]] = None,
    seed: int = DEFAULT_SEED,
    iterations: int = 1,
    reference_backend: Optional[Backend] = None,
) -> Tuple[List[Feed], List[Feed], str]:
    """(inputs, goldens, where the goldens come from), validated against the model.

    Inputs come from ``load_inputs_path`` or are generated as Polygraphy would for the same
    ``--val-range``/``--seed``/``--iterations`` (as many iterations as the loaded goldens hold
    when ``iterations`` is left at 1); goldens from ``load_outputs_path`` or computed in fp32
    on the host."""
    goldens = load_outputs(load_outputs_path) if load_outputs_path else None
    if load_inputs_path:
        inputs = load_inputs(load_inputs_path)
    else:
        if goldens is not None and iterations == 1:
            iterations = len(goldens)
        inputs = generate_inputs(input_specs, val_range, seed, iterations)
    validate_inputs(inputs, input_specs)
    source = load_outputs_path or "computed in fp32 ({})".format(
        reference_backend.name if reference_backend else "onnxruntime")
    if goldens is None:
        goldens = reference_outputs(model_path, inputs, reference_backend)
    validate_goldens(goldens, output_specs, len(inputs))
    return inputs, goldens, source
