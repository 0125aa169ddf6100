"""Shapes for a TensorRT build: the optimization profile a plan's shapes make for the network's
inputs (checked against them), and the shapes INT8 calibration runs with. Pure; worker side:
Python >= 3.6.
"""

from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from agent.engines.backends.base import Shape, TensorSpec
from agent.errors import AgentError

ProfileShapes = Dict[str, Tuple[Shape, Shape, Shape]]


def _dynamic(dim: Any) -> bool:
    return dim is None or bool(isinstance(dim, (int, np.integer)) and dim < 0)


def profile_shapes(inputs: Sequence[TensorSpec], shapes: ProfileShapes) -> ProfileShapes:
    """The optimization profile: plan.shapes checked against the network inputs. Inputs with
    dynamic dimensions need an entry (``dynamic_shape`` otherwise); static inputs may omit
    theirs. Every shape must have the input's rank and keep its static dimensions."""
    names = {spec.name for spec in inputs}
    unknown = sorted(set(shapes) - names)
    if unknown:
        raise AgentError("bad_argument",
                         "shape given for {!r}, which is not a model input (inputs: {})".format(
                             unknown[0], ", ".join(sorted(names))))
    out: ProfileShapes = {}
    missing = []
    for spec in inputs:
        dynamic = any(_dynamic(d) for d in spec.shape)
        if spec.name not in shapes:
            if dynamic:
                missing.append(spec)
            continue
        triple = tuple(tuple(int(d) for d in s) for s in shapes[spec.name])
        if len(triple) != 3:
            raise AgentError("bad_argument",
                             "input {!r}: expected (min, opt, max) shapes, found {}".format(
                                 spec.name, len(triple)))
        for label, shape in zip(("min", "opt", "max"), triple):
            ok = len(shape) == len(spec.shape) and all(
                _dynamic(want) or want == got for want, got in zip(spec.shape, shape))
            if not ok or any(d < 0 for d in shape):
                raise AgentError(
                    "bad_argument",
                    "input {!r}: {} shape {} does not fit the model's shape {}".format(
                        spec.name, label, list(shape), shape_text(spec.shape)))
        lo, opt, hi = triple
        if not all(a <= b <= c for a, b, c in zip(lo, opt, hi)):
            raise AgentError("bad_argument",
                             "input {!r}: expected min <= opt <= max per dimension, found {} "
                             "{} {}".format(spec.name, list(lo), list(opt), list(hi)))
        out[spec.name] = (lo, opt, hi)
    if missing:
        raise AgentError(
            "dynamic_shape",
            "input(s) {} have dynamic dimensions and no shape profile was given (expected "
            "min/opt/max shapes for each, e.g. {}:{})".format(
                ", ".join("{!r} {}".format(s.name, shape_text(s.shape)) for s in missing),
                missing[0].name,
                "x".join("1" if _dynamic(d) else str(int(d)) for d in missing[0].shape)),
            {"inputs": [s.name for s in missing]})
    return out


def shape_text(shape: Sequence[Any]) -> str:
    return "[" + ", ".join("?" if _dynamic(d) else str(int(d)) for d in shape) + "]"


def calibration_shapes(inputs: Sequence[TensorSpec], profile: ProfileShapes,
                       batch_size: int) -> Tuple[int, Dict[str, Shape], List[str]]:
    """The batch size and per-input shapes calibration runs with, plus notes.

    A static leading dimension fixes the batch size (the requested one is overridden with a
    note); a dynamic one takes the requested batch size; other dynamic dimensions take the
    profile's opt value."""
    notes: List[str] = []
    static = sorted({int(s.shape[0]) for s in inputs if s.shape and not _dynamic(s.shape[0])})
    batch = int(batch_size)
    if static:
        if len(static) > 1:
            raise AgentError("unsupported_model",
                             "inputs have different fixed batch sizes {}: cannot "
                             "calibrate".format(static))
        if static[0] != batch:
            notes.append("calibration batch size {} replaced by the model's fixed batch "
                         "size {}".format(batch, static[0]))
            batch = static[0]
    out: Dict[str, Shape] = {}
    for spec in inputs:
        opt = profile[spec.name][1] if spec.name in profile else None
        dims = []
        for axis, dim in enumerate(spec.shape):
            if not _dynamic(dim):
                dims.append(int(dim))
            elif axis == 0:
                dims.append(batch)
            else:
                dims.append(int(opt[axis]) if opt is not None else 1)
        out[spec.name] = tuple(dims)
    return batch, out, notes


def range_profile(shapes: Dict[str, Shape], profile: ProfileShapes) -> ProfileShapes:
    """The range engine's profile: batch 1 .. calibration batch on dynamic batch dimensions
    (a dataset's last, smaller batch must fit), the calibration shape elsewhere."""
    out: ProfileShapes = {}
    for name, shape in shapes.items():
        if name not in profile:
            continue
        lo = tuple([1] + list(shape[1:])) if shape else shape
        out[name] = (lo, shape, shape)
    return out
