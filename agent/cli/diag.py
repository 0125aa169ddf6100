"""``jetson-agent diag``: what this machine is, what it can run, and what to fix.

Board, versions, support-matrix row and precisions, which backends are importable here, the
telemetry source with one sample, the models directory's health (a dangling ``current``, a
missing or truncated engine; ``--verify`` also checks each engine's sha256), and one line per
problem with its fix. Problems are reported,
not raised: the exit status is 0 whenever the inputs could be read. ``--json`` prints the report
documented in docs/platform.md. ``--root DIR`` reads a recorded tree instead of this machine
(backends are still this machine's).
"""

import argparse
import importlib.util
import json
import os
from typing import Any, Dict, List, Optional

from agent import __version__
from agent import platform as plat
from agent.cli import telemetry_view
from agent.cli.models_location import add_models_dir_arg, models_dir
from agent.device import telemetry

# The daemon warns at start-up with the same fixes.
from agent.device.backend_check import FIX_ONNXRUNTIME, FIX_PYCUDA, FIX_TENSORRT
from agent.errors import AgentError

SCHEMA = "jetson-agent/diag/1"
# module name -> what it is for; checked with find_spec (never imported: tensorrt is heavy).
BACKEND_MODULES = (
    ("tensorrt", "TensorRT engines (device backend)"),
    ("pycuda", "device buffers for TensorRT INT8 calibration"),
    ("onnxruntime", "host backend: fp32 and emulated fp16/int8"),
)
DEFAULT_CONFIG = "/etc/jetson-agent/config.yaml"  # what the systemd unit runs with


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "diag", help="show the board, versions, supported precisions and problems to fix",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--root", default="/", metavar="DIR",
                   help="read /proc, /sys, /etc, /usr under DIR (a recorded tree) instead of /")
    p.add_argument("--no-jtop", action="store_true", help="do not ask the jtop service")
    p.add_argument("--matrix", metavar="YAML",
                   help="support matrix to use (default: the packaged support_matrix.yaml)")
    p.add_argument("--config", metavar="FILE",
                   help="the daemon's config: report its security posture (TLS, signing); "
                        "default {} when it exists".format(DEFAULT_CONFIG))
    add_models_dir_arg(p)
    p.add_argument("--verify", action="store_true",
                   help="also compare every deployed engine's sha256 with its meta.json "
                        "(reads each engine once)")
    p.set_defaults(func=run)


def _find_spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def backend_report(info: plat.PlatformInfo) -> Dict[str, Dict[str, Any]]:
    """Which backend modules this Python can import (without importing them)."""
    gpu = info.kind in ("jetson", "dgpu")
    out = {}
    for name, purpose in BACKEND_MODULES:
        importable = _find_spec(name)
        version = plat.dist_version(name) if importable else None
        if name == "onnxruntime" and importable and not version:
            version = plat.dist_version("onnxruntime-gpu")
        usable = importable and (gpu or name == "onnxruntime")
        out[name] = {"importable": importable, "version": version, "usable": usable,
                     "purpose": purpose}
    return out


def _backend_problems(info: plat.PlatformInfo, backends: Dict[str, Dict[str, Any]]
                      ) -> List[Dict[str, str]]:
    out = []
    if info.kind in ("jetson", "dgpu"):
        if not backends["tensorrt"]["importable"]:
            out.append(plat.problem("TensorRT Python bindings are not importable by {}".format(
                "this Python"), FIX_TENSORRT))
        elif not backends["pycuda"]["importable"]:
            out.append(plat.problem("pycuda is not importable: INT8 calibration on the device "
                                    "needs it", FIX_PYCUDA))
    if not backends["onnxruntime"]["importable"]:
        out.append(plat.problem("onnxruntime is not importable: no host backend", FIX_ONNXRUNTIME))
    return out


def default_backend(info: plat.PlatformInfo, backends: Dict[str, Dict[str, Any]]
                    ) -> Optional[str]:
    if backends.get(info.backend, {}).get("usable"):
        return info.backend
    return "onnxruntime" if backends["onnxruntime"]["usable"] else None


def models_report(path: str, verify: bool = False) -> Dict[str, Any]:
    """The models directory's health (``agent.device.models.guard.check_models``)."""
    from agent.device.models import guard as models_guard

    problems = models_guard.check_models(path, verify=verify)
    return {"dir": path, "exists": os.path.isdir(path), "verified": verify,
            "problems": problems}


def collect(root: str = "/", use_jtop: bool = True, matrix_path: Optional[str] = None,
            config_path: Optional[str] = None, models_path: Optional[str] = None,
            verify: bool = False) -> Dict[str, Any]:
    """The diag report (see docs/platform.md). Raises AgentError only for unreadable inputs."""
    if not os.path.isdir(root):
        raise AgentError("file_not_found",
                         "--root {!r}: expected a directory holding a recorded tree, found "
                         "{}".format(root, "a file" if os.path.exists(root) else "nothing"))
    matrix = plat.load_matrix(matrix_path)
    info = plat.detect(root, use_jtop=use_jtop, matrix=matrix)
    live = info.root == "/"
    backends = backend_report(info)
    source = telemetry.open_source(root, use_jtop=use_jtop)
    try:
        sample = source.sample()
    finally:
        source.close()
    problems = []  # type: List[Dict[str, str]]

    def add(items: List[Dict[str, str]], where: str) -> None:
        for item in items:
            entry = {"problem": item["problem"], "fix": item["fix"], "source": where}
            if item.get("code"):
                entry["code"] = item["code"]
            if not any(p["problem"] == entry["problem"] for p in problems):
                problems.append(entry)

    add(info.problems, "platform")
    add(source.problems, "telemetry")
    if live:  # backends are this machine's: only meaningful for the live system
        add(_backend_problems(info, backends), "backends")
    security = None
    if config_path is not None:
        from agent.device import config
        from agent.wire.device import security_posture

        security = security_posture.posture(config.load(config_path))
        add(security["problems"], "security")
    models = None
    if models_path is not None:
        models = models_report(models_path, verify)
        add(models["problems"], "models")
    report = {
        "schema": SCHEMA,
        "agent_version": __version__,
        "root": info.root,
        "platform": info.to_dict(),
        "backends": backends,
        "backends_checked_on": "this machine" if live else "this machine, not the --root tree",
        "default_backend": default_backend(info, backends),
        "telemetry": {"source": source.kind, "sample": sample},
        "problems": problems,
        "ok": not problems,
    }
    if security is not None:
        report["security"] = security
    if models is not None:
        report["models"] = models
    return report


# --------------------------------------------------------------------------- human output

def _v(value: Any) -> str:
    return "-" if value in (None, "", []) else str(value)


def _versions_line(p: Dict[str, Any], what: str) -> str:
    value = p.get(what)
    src = p["versions_source"].get(what)
    return "{}{}".format(_v(value), "  ({})".format(src) if value and src else "")


def render(report: Dict[str, Any]) -> str:
    """A readable two-column table."""
    p = report["platform"]
    row = p["matrix_row"]
    rows = [("board", p["board"]), ("kind", p["kind"])]
    if p["kind"] == "jetson":
        rows += [("module", "{}{}".format(_v(p["module"]), "  ({})".format(p["part_number"])
                                          if p["part_number"] else "")),
                 ("SoC / GPU", "{} / {}".format(_v(p["soc"]), _v(p["gpu_arch"]))),
                 ("L4T / JetPack", "{} / {}".format(_v(p["l4t"]), _v(p["jetpack"])))]
    if p["gpus"]:
        rows.append(("GPUs", ", ".join(g["name"] for g in p["gpus"])))
    rows += [("compute capability", _v(p["compute_capability"])),
             ("CUDA", _versions_line(p, "cuda")),
             ("TensorRT", _versions_line(p, "tensorrt")),
             ("cuDNN", _versions_line(p, "cudnn")),
             ("DLA cores", "{}  ({})".format(p["dla_cores"], p["dla_source"])
              if p["kind"] == "jetson" else "-"),
             ("memory", "{} MiB".format(p["memory_total_mb"]) if p["memory_total_mb"] else "-"),
             ("matrix row", "{}: {}{}".format(row["id"], row["name"],
                                              "  (matched by {})".format(row["matched_by"])
                                              if row.get("matched_by") else "")),
             ("backend", "{} (platform)  ->  {} usable here".format(
                 p["backend"], _v(report["default_backend"])))]
    for prec, level in p["precisions"].items():
        if level == "native":
            text = "yes"
        elif level == "emulated":
            text = "emulated (onnxruntime: numerics, not speed)"
        else:
            note = row.get("precision_notes", {}).get(prec)
            text = "no" + ("  - " + note if note else "")
        rows.append(("precision " + prec, text))
    for name, b in report["backends"].items():
        rows.append(("python: " + name, "{}{}".format(
            "importable" if b["importable"] else "not importable",
            " " + b["version"] if b["version"] else "")))
    rows.append(("telemetry", "{} (sample below)".format(report["telemetry"]["source"])))
    sec = report.get("security")
    if sec is not None:
        rows.append(("broker TLS", "on ({}verified server{})".format(
            "" if sec["verify_server"] else "UN", ", client certificate"
            if sec["client_certificate"] else "") if sec["tls"] else "OFF"))
        rows.append(("job signing", "{}{}".format(sec["signing"], " (keys {})".format(
            ", ".join(sec["trusted_keys"])) if sec["trusted_keys"] else " (no trusted key)")))
    models = report.get("models")
    if models is not None:
        rows.append(("models", "{}{}".format(models["dir"], "" if models["exists"]
                                              else " (none deployed yet)")))
    width = max(len(k) for k, _ in rows)
    lines = ["jetson-agent {} diag{}".format(report["agent_version"],
                                             "  (root " + report["root"] + ")"
                                             if report["root"] != "/" else "")]
    lines += ["  {}  {}".format(k.ljust(width), v) for k, v in rows]
    sample = telemetry_view.table(report["telemetry"]["sample"], indent="    ")
    if sample:
        lines.append("  telemetry sample ({}):".format(report["telemetry"]["source"]))
        lines += sample
    if report["backends_checked_on"] != "this machine":
        lines.append("  (python modules are this machine's, not the recorded tree's)")
    if report["problems"]:
        lines.append("problems ({}):".format(len(report["problems"])))
        for prob in report["problems"]:
            lines.append("  - {}{}\n      fix: {}".format(
                prob["problem"], " [{}]".format(prob["code"]) if prob.get("code") else "",
                prob["fix"]))
    else:
        lines.append("no problems found")
    return "\n".join(lines)


def _models_path(args: argparse.Namespace, config_path: Optional[str]) -> Optional[str]:
    """--models-dir, else the daemon's (from its config), else the default state directory's;
    None for a recorded --root tree (its models are not on this machine)."""
    if args.models_dir:
        return os.path.abspath(args.models_dir)
    if args.root not in ("/", "") and os.path.abspath(args.root) != "/":
        return None
    if config_path is not None:
        from agent.cli.status import daemon_dirs

        cfg, state, _cache = daemon_dirs(config_path)
        return models_dir(args, state, cfg)
    from agent import fsio

    return models_dir(args, fsio.state_dir())


def run(args: argparse.Namespace) -> int:
    config_path = args.config
    if config_path is None and os.path.isfile(DEFAULT_CONFIG):
        config_path = DEFAULT_CONFIG
    report = collect(args.root, use_jtop=not args.no_jtop, matrix_path=args.matrix,
                     config_path=config_path, models_path=_models_path(args, config_path),
                     verify=args.verify)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=False, default=str))
    else:
        print(render(report))
    return 0
