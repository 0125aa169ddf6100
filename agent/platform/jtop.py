"""The jtop service (jetson-stats): connecting within a timeout, mapping its failure modes to one
problem line with the fix, and applying its board info to a ``PlatformInfo``. jtop itself is
imported lazily: jetson-stats is only needed on devices.
"""

import threading
from typing import Any, Callable, Dict, Optional, Tuple

from agent.platform.info import PlatformInfo, Problem, problem
from agent.platform.parsers import _VERSION_RE

JTOP_SOCKET = "/run/jtop.sock"
JTOP_TIMEOUT_S = 4.0

FIX_JTOP_SERVICE = "sudo systemctl enable --now jtop"
FIX_JTOP_GROUP = "sudo usermod -aG jtop $USER, then log out and back in"
FIX_JTOP_INSTALL = "sudo pip3 install -U jetson-stats, then sudo systemctl enable --now jtop"

JtopFactory = Callable[[], Any]


def _default_jtop_factory(interval: float = 1.0) -> JtopFactory:
    from jtop import jtop  # noqa: PLC0415 - lazy: jetson-stats is only needed on devices

    return lambda: jtop(interval=interval)


def jtop_problem(exc: BaseException) -> Problem:
    """Map jtop's failure modes to one problem line with its fix."""
    text = str(exc)
    if isinstance(exc, ImportError):
        return problem("jetson-stats (jtop) is not installed", FIX_JTOP_INSTALL)
    if isinstance(exc, PermissionError) or "can't access" in text or "ermission" in text:
        return problem("user not in group jtop (cannot open {})".format(JTOP_SOCKET),
                       FIX_JTOP_GROUP)
    if "Mismatch" in text:
        return problem("jtop service and client versions differ: " + text.splitlines()[0],
                       "sudo pip3 install -U jetson-stats && sudo systemctl restart jtop")
    if isinstance(exc, TimeoutError):
        return problem("jtop service did not answer within {:.0f} s".format(JTOP_TIMEOUT_S),
                       "sudo systemctl restart jtop")
    if (isinstance(exc, (ConnectionRefusedError, FileNotFoundError)) or "not active" in text
            or "Lost connection" in text):
        return problem("jtop service not running", FIX_JTOP_SERVICE)
    return problem("jtop service unusable: {}".format(text.splitlines()[0] if text else
                                                       type(exc).__name__), FIX_JTOP_SERVICE)


def connect_jtop(factory: Optional[JtopFactory] = None, timeout: float = JTOP_TIMEOUT_S,
                 interval: float = 1.0) -> Tuple[Any, Optional[Problem]]:
    """Start a jtop client within ``timeout`` seconds: (client, None) or (None, problem).
    Never raises: every jtop failure becomes a problem line."""
    try:
        make = factory or _default_jtop_factory(interval)
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken jetson-stats install
        return None, jtop_problem(exc)
    box: Dict[str, Any] = {}
    gave_up = threading.Event()

    def run() -> None:
        try:
            client = make()
            client.start()
        except BaseException as exc:  # noqa: BLE001 - reported as a problem line
            box["error"] = exc
            return
        if gave_up.is_set():
            _close_quietly(client)
        else:
            box["client"] = client

    worker = threading.Thread(target=run, name="jtop-connect", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        gave_up.set()
        return None, jtop_problem(TimeoutError())
    if "error" in box:
        return None, jtop_problem(box["error"])
    return box["client"], None


def _close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing a broken client must not fail the caller
        pass


def jtop_dla_cores(client: Any) -> Optional[int]:
    """DLA cores from jtop's engine groups (``DLA0``, ``DLA1``), None when it has none."""
    try:
        engines = client.engine
    except Exception:  # noqa: BLE001 - older jtop versions have no engine property
        return None
    if not isinstance(engines, dict):
        return None
    count = sum(1 for name in engines if str(name).upper().startswith("DLA"))
    return count if count else None


def _apply_jtop(info: PlatformInfo, client: Any) -> None:
    """Use jtop's board info: the module from the EEPROM part number, run-time libraries."""
    try:
        board = client.board or {}
    except Exception as exc:  # noqa: BLE001 - a broken service is a problem line
        info.add_problem(**jtop_problem(exc))
        return
    info.jtop_used = True
    hw = board.get("hardware") or {}
    libs = board.get("libraries") or {}
    if hw.get("Module") and not info.module:
        info.module = str(hw["Module"])
    if hw.get("P-Number") and not info.part_number:
        info.part_number = str(hw["P-Number"])
    if hw.get("L4T") and not info.l4t and _VERSION_RE.match(str(hw["L4T"])):
        info.l4t = str(hw["L4T"])
        info.versions_source["l4t"] = "jtop"
    if hw.get("Jetpack") and not info.jetpack:
        info.jetpack = str(hw["Jetpack"]).split()[0]
        info.versions_source["jetpack"] = "jtop"
    for key, what in (("CUDA", "cuda"), ("TensorRT", "tensorrt"), ("cuDNN", "cudnn")):
        value = str(libs.get(key) or "")
        if _VERSION_RE.match(value):
            # Run-time versions win over files and tables.
            setattr(info, what, value)
            info.versions_source[what] = "jtop"
    cores = jtop_dla_cores(client)
    if cores is not None:
        info.dla_cores = cores
        info.dla_source = "jtop"
