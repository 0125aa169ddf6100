"""The per-layer view: what ``jetson-agent inspect`` prints (Polygraphy's ``inspect model`` /
``inspect engine``, trtexec's ``--exportLayerInfo``) and the per-layer times of ``bench
--profile`` in trtexec's ``--exportProfile`` JSON shape, so the tools that read trtexec's
files read ours.

A row is one layer: ``name``, ``type``, ``precision``, ``placement`` (GPU, DLA, or the host's
emulation), ``tactic`` where the engine says it, ``qdq`` (a QuantizeLinear / DequantizeLinear
node, or a layer reading one: explicit quantization), ``plugin`` (an op outside the standard
ONNX domain or a TensorRT plugin name, ``*_TRT``) and ``inside`` (nodes inside its subgraphs).

Pure functions of a model, a build's metadata, or the engine inspector's JSON (TensorRT's
I/O lives in the backends). Worker side: Python >= 3.6.
"""

import json
from typing import Any, Dict, List, Optional, Sequence

QDQ_OPS = frozenset(["QuantizeLinear", "DequantizeLinear"])
HOST_PLACEMENT = "host (emulated)"


def _plugin(node: Any) -> bool:
    return node.domain not in ("", "ai.onnx") or node.op_type.endswith("_TRT")


def model_rows(model: Any, assignment: Dict[str, str], placement: str = HOST_PLACEMENT
               ) -> List[Dict[str, Any]]:
    """One row per top-level node of an ONNX ``model``; ``assignment`` (node -> precision,
    ``layer_precisions.resolve_precisions`` or a host engine's metadata) says what each float
    layer runs in; the others are ``-`` (no float computation)."""
    from agent.engines.backends import subgraphs

    dq_outputs = set(o for n in model.graph.node if n.op_type == "DequantizeLinear"
                     for o in n.output)
    rows = []
    for node in model.graph.node:
        inside = sum(1 for _ in subgraphs.walk_node(node))
        rows.append({
            "name": node.name,
            "type": node.op_type,
            "precision": assignment.get(node.name, "-"),
            "placement": placement,
            "tactic": None,
            "qdq": node.op_type in QDQ_OPS or any(i in dq_outputs for i in node.input),
            "plugin": _plugin(node),
            "inside": inside,
        })
    return rows


def engine_rows(info: str) -> List[Dict[str, Any]]:
    """One row per layer of the engine inspector's JSON (``get_engine_information``, 8.2 -
    11). Precision, tactic and placement need a build with detailed profiling verbosity; an
    engine without it lists bare names."""
    from agent.engines.backends.tensorrt_inspect import parse_engine_information

    try:
        doc = json.loads(info)
    except ValueError:
        doc = {}
    entries = doc.get("Layers", []) if isinstance(doc, dict) else []
    rows = []
    for layer, entry in zip(parse_engine_information(info),
                            [e for e in entries if isinstance(e, (str, dict))]):
        entry = entry if isinstance(entry, dict) else {}
        kind = layer.layer_type
        on_dla = "dla" in kind.lower() or "dla" in str(entry.get("Origin", "")).lower()
        tactic = entry.get("TacticName") or entry.get("TacticValue")
        rows.append({
            "name": layer.name,
            "type": kind or "-",
            "precision": layer.precision or "-",
            "placement": "DLA" if on_dla else ("GPU" if kind else "-"),
            "tactic": str(tactic) if tactic not in (None, "") else None,
            "qdq": kind.lower() in ("quantize", "dequantize", "qdq") or
            "QuantizeLinear" in layer.name or "DequantizeLinear" in layer.name,
            "plugin": kind.lower().startswith("plugin") or "_TRT" in layer.name,
            "inside": 0,
        })
    return rows


def summary(rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Counts a reader wants first: layers per precision and per placement, Q/DQ, plugins."""
    def count(key: str) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for row in rows:
            out[str(row[key])] = out.get(str(row[key]), 0) + 1
        return dict(sorted(out.items()))

    return {"layers": len(rows), "precisions": count("precision"),
            "placements": count("placement"), "qdq": sum(1 for r in rows if r["qdq"]),
            "plugins": sorted(set(r["type"] for r in rows if r["plugin"])),
            "inside_subgraphs": sum(int(r["inside"]) for r in rows)}


def format_rows(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """A fixed-width table, one line per layer."""
    header = ("layer", "type", "precision", "placement", "tactic / notes")
    body = []
    for row in rows:
        notes = [row["tactic"]] if row.get("tactic") else []
        if row["qdq"]:
            notes.append("Q/DQ")
        if row["plugin"]:
            notes.append("plugin")
        if row["inside"]:
            notes.append("{} nodes inside".format(row["inside"]))
        body.append((row["name"], row["type"], row["precision"], row["placement"],
                     ", ".join(notes)))
    widths = [min(48, max([len(header[i])] + [len(b[i]) for b in body])) for i in range(4)]
    return [("  ".join(str(cell).ljust(w) for cell, w in zip(line[:4], widths)) + "  " +
             line[4]).rstrip() for line in [header] + body]


# -- per-layer times (trtexec --exportProfile) -----------------------------------------------

def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def export_profile(times: Dict[str, List[float]], runs: int,
                   extra: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """trtexec's ``--exportProfile`` JSON: ``[{"count": runs}, {"name", "timeMs",
    "averageMs", "medianMs", "percentage"}, ...]`` with ``times`` = layer -> its time in each
    run (ms), in the order given. ``extra`` goes into the first element (which tools read for
    ``count`` only), e.g. ``{"emulated": true}``."""
    total = sum(sum(v) for v in times.values()) or 1.0
    head: Dict[str, Any] = {"count": int(runs)}
    head.update(extra or {})
    out: List[Dict[str, Any]] = [head]
    for name, values in times.items():
        spent = sum(values)
        out.append({"name": name, "timeMs": spent, "averageMs": spent / max(1, runs),
                    "medianMs": _median(values) if values else 0.0,
                    "percentage": 100.0 * spent / total})
    return out


def ort_layer_times(events: Sequence[Any]) -> Dict[str, List[float]]:
    """Layer -> per-run kernel times (ms) from ONNX Runtime's profiler JSON (``cat`` "Node",
    ``<node>_kernel_time`` events, ``dur`` in microseconds), in first-seen order."""
    out: Dict[str, List[float]] = {}
    for event in events:
        if not isinstance(event, dict) or event.get("cat") != "Node":
            continue
        name = str(event.get("name", ""))
        if not name.endswith("_kernel_time"):
            continue
        try:
            ms = float(event.get("dur", 0)) / 1000.0
        except (TypeError, ValueError):
            continue
        out.setdefault(name[:-len("_kernel_time")], []).append(ms)
    return out
