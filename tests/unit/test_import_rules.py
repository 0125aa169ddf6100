"""The import rules between agent's packages (docs/architecture.md), read from the source with
``ast``: nothing is imported or run, so lazy imports inside functions count as much as top-level
ones. Imports under ``if TYPE_CHECKING:`` are left out: they never run."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The modules directly under agent/ that every package may use; anything new there must be
# placed in a package (or added here on purpose).
BASE = {"agent", "agent.errors", "agent.fsio", "agent.log", "agent.progress",
        "agent.client", "agent.heap",  # agent.client: the apps' library, standard library only
        "agent.version_key"}  # the one version parser: platform and engines both need it
ENTRY = {"agent.__main__"}  # `python -m agent`: the CLI

# package -> the packages it may import (besides itself and the third-party rules below).
ALLOWED = {
    "base": set(),
    "platform": {"base"},
    "wire": {"base"},
    "engines": {"base", "calib"},
    "calib": {"base", "engines"},
    "precision": {"base", "engines", "calib"},
    "worker": {"base", "engines", "precision", "calib", "platform"},
    "device": {"base", "wire", "engines", "precision", "platform", "worker"},
    "fleet": {"base", "wire", "engines", "precision", "platform", "calib"},
    "cli": {"base", "wire", "engines", "precision", "platform", "worker", "device", "fleet",
            "calib"},
}
# Known crossings, each a module and the one module it reaches: move them, don't add to them.
EXCEPTIONS = {
    ("agent.fleet.mqtt_edge", "agent.device.config"),  # parse_broker_url
}
# agent.fleet's subpackages, by concern -> the subpackages each may import (besides itself): no
# circles. The wiring (``agent.fleet`` itself, ``service``, ``mqtt_edge``) may import them all;
# no subpackage imports the wiring.
FLEET = {
    "database": set(),
    "transfer": set(),
    "admission": set(),
    "rollouts": {"database", "transfer"},
    "deployments": {"database", "rollouts", "transfer"},
    "web": {"database", "rollouts", "deployments", "admission", "transfer"},
    # what `jetson-agent fleet ...` does; the only subpackage that may use the wiring
    "commands": {"database", "rollouts", "deployments", "admission", "transfer", "web",
                 "wiring"},
    # fleet serve's parts (agent.fleet.parts): only the wiring imports them
    "parts": {"database", "rollouts", "deployments", "admission", "transfer"},
}
FLEET_WIRING = {"agent.fleet", "agent.fleet.service", "agent.fleet.mqtt_edge"}
# argparse: the CLI and the process entries only. agent.worker is the worker process's own
# entry (`python -m agent.worker`, started by the daemon under another interpreter, Python 3.6
# on JetPack 4.6): it may not import the CLI, so it parses its two flags itself.
ARGPARSE = {"agent.__main__", "agent.worker"}  # besides the package cli
# The wire modules only a device imports (agent/wire/device/): the controller (agent.fleet and
# the fleet CLI) never does, directly or through another module it loads.
DEVICE_WIRE = "agent.wire.device"
CONTROLLER = ("agent.fleet", "agent.cli.fleet")
# Third-party modules that only some packages may import.
ONLY = {
    "paho": {"wire"},
    "tensorrt": {"engines", "calib"},
    "tensorrt_libs": {"engines", "calib"},
    "tensorrt_bindings": {"engines", "calib"},
    "pycuda": {"engines", "calib"},
    "onnxruntime": {"engines", "calib"},
}
# Third-party modules that only some modules may import (a module, or a package and what is
# under it): the fleet database's schema and migrations (SQLAlchemy and Alembic are the
# controller's; the daemon, the wire and the worker never load them, and the CLI only when a
# schema changes).
ONLY_MODULES = {
    "grpc": {"agent.device.handoff.triton_grpc"},  # Triton's model control, optional
    "sqlalchemy": {"agent.fleet.database.tables", "agent.fleet.database.migrate",
                   "agent.fleet.database.migrations"},
    "alembic": {"agent.fleet.database.tables", "agent.fleet.database.migrate",
                "agent.fleet.database.migrations"},
    # the dashboard's templates (the controller's; autoescaped)
    "jinja2": {"agent.fleet.web.pages"},
    "markupsafe": {"agent.fleet.web.pages"},
}


def module_name(path):
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def package_of(module):
    parts = module.split(".")
    if parts[0] == "calib":
        return "calib"
    if module in BASE:
        return "base"
    if module in ENTRY:
        return "entry"
    if len(parts) >= 2 and parts[1] in ALLOWED:
        return parts[1]
    return None


def sources():
    for top in ("agent", "calib"):
        for root, _dirs, files in os.walk(os.path.join(ROOT, top)):
            for name in sorted(files):
                if name.endswith(".py"):
                    yield os.path.join(root, name)


def _type_checking_only(node):
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runnable(path):
    """The import nodes of ``path`` that can run (those under ``if TYPE_CHECKING:`` never do)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _type_checking_only(node):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    for node in ast.walk(tree):
        if id(node) not in skip and isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def imports(path):
    """(line, imported module) for every import that can run, resolving `from agent import x`."""
    for node in _runnable(path):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif node.module and not node.level:
            if node.module in ("agent", "calib"):
                for alias in node.names:
                    yield node.lineno, node.module + "." + alias.name
            else:
                yield node.lineno, node.module


def module_imports(path, known):
    """(line, module) for each module of ``known`` an import of ``path`` that can run loads
    (``from a.b import c`` may name a module ``a.b.c`` or a name in ``a.b``)."""
    for node in _runnable(path):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif node.module and not node.level:
            names = [node.module] + [node.module + "." + a.name for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                yield node.lineno, name


def test_every_module_has_a_package():
    unplaced = [module_name(p) for p in sources() if package_of(module_name(p)) is None]
    assert not unplaced, "put these in a package (or name them in BASE): {}".format(unplaced)


def test_packages_import_only_what_their_rules_allow():
    broken = []
    for path in sources():
        module = module_name(path)
        own = package_of(module)
        if own in (None, "entry"):
            continue
        for line, target in imports(path):
            top = target.split(".")[0]
            if top in ONLY and own not in ONLY[top]:
                broken.append("{}:{} imports {} (only {} may)".format(
                    module, line, target, ", ".join(sorted(ONLY[top]))))
            if top in ONLY_MODULES and not any(
                    module == m or module.startswith(m + ".") for m in ONLY_MODULES[top]):
                broken.append("{}:{} imports {} (only {} may)".format(
                    module, line, target, ", ".join(sorted(ONLY_MODULES[top]))))
            if top not in ("agent", "calib"):
                continue
            theirs = package_of(target)
            if theirs is None and target not in BASE:  # `from agent import __version__`
                theirs = "base" if len(target.split(".")) == 2 else None
            if theirs in (None, own) or theirs in ALLOWED[own]:
                continue
            if any(module == m and (target == t or target.startswith(t + "."))
                   for m, t in EXCEPTIONS):
                continue
            broken.append("{}:{} imports {} ({} may not use {})".format(
                module, line, target, own, theirs))
    assert not broken, "\n".join(broken)


def fleet_part(module):
    """The subpackage of agent.fleet a module is in, "wiring", or None outside agent.fleet."""
    parts = module.split(".")
    if parts[:2] != ["agent", "fleet"]:
        return None
    if module in FLEET_WIRING:
        return "wiring"
    return parts[2] if len(parts) >= 4 or parts[2] in FLEET else "unplaced"


def test_fleet_modules_sit_in_their_subpackages_and_import_no_circle():
    broken = []
    for path in sources():
        module = module_name(path)
        own = fleet_part(module)
        if own is None or own == "wiring":
            continue
        if own not in FLEET:
            broken.append("{}: put it in one of agent.fleet's subpackages {}".format(
                module, sorted(FLEET)))
            continue
        for line, target in imports(path):
            if target.split(".")[:2] == ["agent", "fleet"] and target not in FLEET_WIRING:
                if len(target.split(".")) == 3 and target.split(".")[2] not in FLEET:
                    target = "agent.fleet"  # `from agent.fleet import Name`: the wiring
            theirs = fleet_part(target)
            if theirs in (None, own) or theirs in FLEET[own]:
                continue
            broken.append("{}:{} imports {} (fleet.{} may not use {})".format(
                module, line, target, own, theirs))
    assert not broken, "\n".join(broken)


def test_the_fleet_wiring_never_imports_the_commands():
    """The commands use the wiring (``FleetService``), never the reverse."""
    broken = ["{}:{} imports {}".format(module_name(path), line, target)
              for path in sources() if fleet_part(module_name(path)) == "wiring"
              for line, target in imports(path) if fleet_part(target) == "commands"]
    assert not broken, "\n".join(broken)


def test_nothing_in_fleet_imports_the_cli():
    """The controller's logic is agent.fleet's (agent.fleet.commands); the CLI parses and
    prints. No crossing is listed for it."""
    broken = ["{}:{} imports {}".format(module_name(path), line, target)
              for path in sources() if fleet_part(module_name(path)) is not None
              for line, target in imports(path) if package_of(target) == "cli"]
    assert not broken, "\n".join(broken)
    assert not any(package_of(t) == "cli" for m, t in EXCEPTIONS if package_of(m) == "fleet")


def test_argparse_only_in_the_cli_and_the_process_entries():
    broken = ["{}:{} imports {}".format(module_name(path), line, target)
              for path in sources()
              if module_name(path) not in ARGPARSE and package_of(module_name(path)) != "cli"
              for line, target in imports(path) if target.split(".")[0] == "argparse"]
    assert not broken, "argparse outside agent.cli and {}:\n{}".format(
        sorted(ARGPARSE), "\n".join(broken))


def test_the_fleet_serve_parts_reach_each_other_only_through_the_wiring():
    """A part of ``fleet serve`` (agent.fleet.parts) imports no other part: it is handed its
    collaborators by ``agent.fleet.service.assemble``."""
    broken = []
    for path in sources():
        module = module_name(path)
        if fleet_part(module) != "parts":
            continue
        for line, target in imports(path):
            if target.startswith("agent.fleet.parts.") and target != module:
                broken.append("{}:{} imports {}".format(module, line, target))
    assert not broken, "\n".join(broken)
def test_the_controller_never_loads_a_device_only_wire_module():
    """What agent.fleet and the fleet CLI import, followed through every module they load
    (lazy imports included): nothing under agent/wire/device/."""
    paths = {module_name(p): p for p in sources()}
    via = {m: [m] for m in paths if m.startswith(CONTROLLER)}
    todo = sorted(via)
    broken = []
    while todo:
        module = todo.pop()
        for line, target in module_imports(paths[module], paths):
            if target in via:
                continue
            via[target] = via[module] + [target]
            if target == DEVICE_WIRE or target.startswith(DEVICE_WIRE + "."):
                broken.append("{} (line {}): {}".format(
                    " -> ".join(via[target]), line, "device-only"))
            else:
                todo.append(target)
    assert not broken, "\n".join(broken)
    assert "agent.fleet.service" in via and "agent.wire.protocol" in via  # it did look


def test_the_fleet_rules_have_no_circle():
    seen = set()

    def visit(part, path):
        assert part not in path, "circle: {}".format(" -> ".join(path + [part]))
        if part not in seen:
            for dep in FLEET[part] - {"wiring"}:  # the wiring imports no subpackage's commands
                visit(dep, path + [part])
            seen.add(part)

    for part in FLEET:
        visit(part, [])


def test_the_rules_catch_a_reverse_import(tmp_path):
    """The checker itself: a wire module importing the daemon, and engines importing paho."""
    src = tmp_path / "m.py"
    src.write_text("from agent.device import daemon\ndef f():\n    import paho.mqtt.client\n"
                   "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from agent.fleet.database import store\n")
    found = sorted(t for _line, t in imports(str(src)))
    assert found == ["agent.device", "paho.mqtt.client", "typing"]  # TYPE_CHECKING left out
    assert package_of("agent.device") not in ALLOWED["wire"]
    assert "engines" not in ONLY["paho"]
    assert not any("agent.device".startswith(m) for m in ONLY_MODULES["sqlalchemy"])


def test_the_cli_and_the_fleet_service_load_no_sqlalchemy_until_a_schema_changes():
    """The modules a CLI command, ``fleet serve`` and the dashboard import: no SQLAlchemy or
    Alembic among what they load (agent.fleet.database.store_schema decides in plain SQL)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import agent.cli, agent.cli.fleet, agent.cli.fleet_serve, agent.cli.fleet_db\n"
            "import agent.fleet.database.store, agent.fleet.service, agent.fleet.database.history\n"
            "import agent.fleet.web, agent.fleet.web.views, agent.device.daemon\n"
            "import agent.fleet.commands.serve, agent.fleet.commands.rollout_run\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('sqlalchemy', 'alembic', 'mako')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
