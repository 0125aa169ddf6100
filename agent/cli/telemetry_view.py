"""Telemetry samples for people: labels, units, percentages and a two-column table.

A sample (``agent.device.telemetry``; the ``metrics`` of a telemetry message) holds fractions,
milliwatts and degrees under machine keys; this turns it into rows such as ``RAM  43.2 %`` or
``power VDD_IN  5.21 W``, in a fixed order, leaving out what the source does not know (sysfs
cannot tell whether jetson_clocks is on: no row rather than ``None``).
"""

import re
from typing import Any, Dict, List, Tuple

Row = Tuple[str, str]

_PERCENT = (("cpu_percent", "CPU"), ("gpu_percent", "GPU"), ("emc_percent", "EMC (memory bus)"))
_FRACTION = (("ram_fraction", "RAM used"), ("swap_fraction", "swap used"))


def _num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _power(mw: float) -> str:
    return "{:.0f} mW".format(mw) if abs(mw) < 1000 else "{:.2f} W".format(mw / 1000.0)


def rows(metrics: Dict[str, Any]) -> List[Row]:
    """(label, value with its unit) for every known value of a sample."""
    if not isinstance(metrics, dict):
        return []
    out: List[Row] = []
    for key, label in _PERCENT:
        if _num(metrics.get(key)):
            out.append((label, "{:.1f} %".format(metrics[key])))
    for key, label in _FRACTION:
        if _num(metrics.get(key)):
            out.append((label, "{:.1f} %".format(100.0 * metrics[key])))
    temps = sorted(k for k in metrics if re.match(r"^temp_.+_c$", k) and _num(metrics[k]))
    for key in temps:
        out.append(("temp " + key[5:-2], "{:.1f} °C".format(metrics[key])))
    if _num(metrics.get("power_total_mw")):
        out.append(("power total", _power(metrics["power_total_mw"])))
    rails = sorted(k for k in metrics if re.match(r"^power_.+_mw$", k)
                   and k != "power_total_mw" and _num(metrics[k]))
    for key in rails:
        out.append(("power " + key[6:-3], _power(metrics[key])))
    if metrics.get("nvpmodel") not in (None, ""):
        out.append(("power mode", str(metrics["nvpmodel"])))
    clocks = metrics.get("jetson_clocks")
    if isinstance(clocks, bool):
        out.append(("jetson_clocks", "on (clocks locked at maximum)" if clocks else "off"))
    known = {k for k, _ in _PERCENT + _FRACTION} | {"power_total_mw", "nvpmodel",
                                                     "jetson_clocks", "source"}
    for key in sorted(metrics):  # anything newer than this table, still shown
        if key in known or key in temps or key in rails or metrics[key] is None:
            continue
        out.append((key, str(metrics[key])))
    return out


def table(metrics: Dict[str, Any], indent: str = "  ") -> List[str]:
    """The rows as aligned lines (empty when the sample holds nothing)."""
    found = rows(metrics)
    if not found:
        return []
    width = max(len(label) for label, _ in found)
    return ["{}{}  {}".format(indent, label.ljust(width), value) for label, value in found]


def summary(metrics: Dict[str, Any], limit: int = 5) -> str:
    """The first rows on one line, for a column of a devices table."""
    found = rows(metrics)[:limit]
    return ", ".join("{} {}".format(label, value) for label, value in found) or "-"
