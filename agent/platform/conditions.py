"""The conditions a figure was measured under: power mode (nvpmodel), clocks and temperatures,
read from sysfs (``root``: a recorded tree in tests). Recorded with every build, bench and
selftest result, so figures from two boards (or one board in two power modes) are compared
knowingly. The small sysfs readers here are shared with the daemon's telemetry
(``agent.device.telemetry``). Imports the standard library only; Python >= 3.6 (the worker
records them too).
"""

import glob
import os
import re
from typing import Any, Dict, List, Optional, Tuple

OFFLINE_TEMP_C = -200.0  # offline sensors read -256 C


def read_text(path: str) -> Optional[str]:
    try:
        with open(path, "r", errors="replace") as f:
            return f.read().strip("\0\n ")
    except (OSError, ValueError):
        return None


def number(text: Optional[str]) -> Optional[float]:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def sensor_key(name: str) -> str:
    """``CPU-therm`` / ``cpu-thermal`` / ``Temp cpu`` sensor names -> ``cpu``."""
    name = re.sub(r"[-_ ]?therm(al)?$", "", name.strip(), flags=re.I)
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "sensor"


def thermal_zones(root: str) -> List[Tuple[str, str]]:
    """(``temp_<sensor>_c``, the zone's temp file) for every thermal zone."""
    zones = []
    for zone in sorted(glob.glob(os.path.join(root, "sys/class/thermal/thermal_zone*"))):
        name = read_text(os.path.join(zone, "type"))
        if name:
            zones.append(("temp_{}_c".format(sensor_key(name)), os.path.join(zone, "temp")))
    return zones


def temperatures(root: str) -> Dict[str, float]:
    out = {}
    for key, path in thermal_zones(root):
        milli = number(read_text(path))
        if milli is not None and milli / 1000.0 > OFFLINE_TEMP_C:
            out[key] = round(milli / 1000.0, 1)
    return out


class NvpModel(object):
    """The active power mode: id from /var/lib/nvpmodel/status, name from /etc/nvpmodel.conf."""

    def __init__(self, root: str) -> None:
        self.status_path = os.path.join(root, "var/lib/nvpmodel/status")
        conf = read_text(os.path.join(root, "etc/nvpmodel.conf")) or ""
        self.names = dict(re.findall(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=(\S+)\s*>", conf))

    def current(self) -> Optional[str]:
        m = re.search(r"pmode:(\d+)", read_text(self.status_path) or "")
        if not m:
            return None
        mode = str(int(m.group(1)))
        return self.names.get(mode, "mode " + mode)


def clocks_mhz(root: str) -> Dict[str, float]:
    """Current clocks: ``gpu`` (the GPU's devfreq ``cur_freq``, Hz) and ``cpu0`` (cpufreq's
    ``scaling_cur_freq``, kHz), in MHz; what sysfs does not have is left out."""
    out = {}
    for node in sorted(glob.glob(os.path.join(root, "sys/class/devfreq/*"))):
        of_name = read_text(os.path.join(node, "device/of_node/name")) or ""
        if "gpu" in os.path.basename(node) or of_name in ("gpu", "gp10b", "gv11b", "ga10b"):
            hz = number(read_text(os.path.join(node, "cur_freq")))
            if hz:
                out["gpu"] = round(hz / 1e6, 1)
                break
    khz = number(read_text(os.path.join(
        root, "sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq")))
    if khz:
        out["cpu0"] = round(khz / 1e3, 1)
    return out


def snapshot(root: str = "/") -> Dict[str, Any]:
    """{"nvpmodel": name or None, "clocks_mhz": {...}, "temperatures_c": {...}}."""
    return {"nvpmodel": NvpModel(root).current(), "clocks_mhz": clocks_mhz(root),
            "temperatures_c": {k[len("temp_"):-len("_c")]: v
                               for k, v in sorted(temperatures(root).items())}}


def describe(snap: Dict[str, Any]) -> str:
    """One line for people: ``power mode MAXN, gpu 1300.5 MHz, cpu0 2201.6 MHz, cpu 45.5 C``
    ("" when nothing is known)."""
    bits = ["power mode {}".format(snap["nvpmodel"])] if snap.get("nvpmodel") else []
    bits += ["{} {:g} MHz".format(k, v) for k, v in sorted(snap.get("clocks_mhz", {}).items())]
    bits += ["{} {:g} C".format(k, v)
             for k, v in sorted(snap.get("temperatures_c", {}).items())]
    return ", ".join(bits)
