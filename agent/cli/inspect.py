"""``jetson-agent inspect MODEL|ENGINE``: the per-layer view (Polygraphy's ``inspect model`` /
``inspect engine``, trtexec's ``--exportLayerInfo``).

One line per layer: type, precision, placement (GPU, DLA, or the host's emulation), the tactic
where the engine says it, Q/DQ (explicit quantization), plugins and the nodes inside
subgraphs. An ONNX model shows what a build of the given precision runs each layer in: the
graph after TensorRT's build-time rewrites (docs/emulation.md), with the same
``--fp16`` / ``--int8`` / ``--best`` / ``--layer-precisions`` as ``build``. An engine built by
the host backend shows what its build recorded; a TensorRT engine (``.engine`` / ``.plan`` /
``.trt``) what the engine inspector says, on a device with TensorRT.
"""

import argparse
import json
import os
from typing import Any, Dict, List, Tuple

from agent.engines import layer_view
from agent.engines.backends.base import parse_layer_precisions

TENSORRT_SUFFIXES = (".engine", ".plan", ".trt")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("inspect", help="the per-layer view of a model or engine",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("target", metavar="MODEL_OR_ENGINE", help="ONNX model or engine file")
    prec = p.add_mutually_exclusive_group()
    for flag in ("fp16", "int8", "best"):
        prec.add_argument("--" + flag, dest="precision", action="store_const", const=flag,
                          help="a model: the layers of a {} build".format(flag))
    p.set_defaults(precision="fp32")
    p.add_argument("--layer-precisions", nargs="+", default=[], metavar="NAME:PRECISION",
                   help="a model: per-layer precisions, as build takes them")
    p.add_argument("--json", action="store_true", help="print the view as JSON on stdout")
    p.set_defaults(func=run)


def model_view(path: str, precision: str, overrides: Dict[str, str]
               ) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """Rows of an ONNX model (or a host-backend engine), and what they describe."""
    from agent.engines.backends import emulation, layer_precisions, onnx_model, quantization
    from agent.engines.backends.onnxruntime import read_metadata

    model = onnx_model.load_model(path)
    metadata = read_metadata(model)
    if metadata:  # a host-backend engine: the layers its build recorded, not the Casts and
        # Q/DQ nodes the emulation added around them
        recorded = metadata.get("layer_precisions") or {}
        rows = [r for r in layer_view.model_rows(model, recorded) if r["name"] in recorded]
        return rows, {"kind": "engine", "backend": metadata.get("backend"),
                      "precision": (metadata.get("plan") or {}).get("precision"),
                      "emulated": True, "emulation_nodes": len(model.graph.node) - len(rows)}
    prepared, merged = emulation.prepare(onnx_model.copy_model(model))
    overrides = {merged.get(k, k): v for k, v in overrides.items()}
    assignment, _, _ = layer_precisions.resolve_precisions(prepared, precision, overrides)
    for name in quantization.int8_layers(model):  # a Q/DQ model: its pairs decide, not the plan
        assignment[name] = quantization.EXPLICIT_LABEL
    for folded, into in merged.items():  # a folded layer runs in the one it joined
        if into in assignment:
            assignment[folded] = assignment[into]
    rows = layer_view.model_rows(model, assignment)
    for row in rows:
        if row["name"] in merged:
            row["tactic"] = "folded into {}".format(merged[row["name"]])
    return rows, {"kind": "model", "precision": precision, "emulated": True,
                  "emulation": emulation.fingerprint()}


def engine_view(path: str) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """Rows of a TensorRT engine, from the engine inspector (needs TensorRT here)."""
    from agent.engines.backends.base import get_backend

    backend = get_backend("tensorrt")
    with backend.open(path) as runner:
        info = runner.engine_information()  # type: ignore[attr-defined]
    return layer_view.engine_rows(info), {"kind": "engine", "backend": "tensorrt",
                                          "version": backend.version(), "emulated": False}


def run(args: argparse.Namespace) -> int:
    from agent.cli.build import require_file

    require_file(args.target, "MODEL_OR_ENGINE", "an ONNX model or an engine file")
    if args.target.lower().endswith(TENSORRT_SUFFIXES):
        rows, about = engine_view(args.target)
    else:
        rows, about = model_view(args.target, args.precision,
                                 parse_layer_precisions(args.layer_precisions))
    about["path"] = os.path.abspath(args.target)
    about["summary"] = layer_view.summary(rows)
    if args.json:
        print(json.dumps({"target": about, "layers": rows}, indent=2, sort_keys=True))
        return 0
    s = about["summary"]
    print("{}: {} ({}{})".format(about["kind"], about["path"], about.get("backend") or
                                 about.get("precision"),
                                 ", emulated on this host" if about["emulated"] else ""))
    print("layers: {} ({}); placement: {}".format(
        s["layers"], ", ".join("{} {}".format(n, p) for p, n in s["precisions"].items()),
        ", ".join("{} {}".format(n, p) for p, n in s["placements"].items())))
    if s["qdq"]:
        print("Q/DQ: {} layer(s) (explicit quantization)".format(s["qdq"]))
    if s["plugins"]:
        print("plugins: {}".format(", ".join(s["plugins"])))
    if s["inside_subgraphs"]:
        print("subgraphs: {} node(s) inside, run in their node's precision".format(
            s["inside_subgraphs"]))
    for line in layer_view.format_rows(rows):
        print(line)
    return 0
