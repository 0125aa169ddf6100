"""Bounds on what a device puts in the registry, so that ``/metrics``, the database and the
dashboard grow with the number of devices times a fixed number of labels, never with what a
device chooses to send: at most ``MAX_TELEMETRY_KEYS`` telemetry metrics per device (each a
number or null under a key of at most ``MAX_KEY_CHARS`` characters), the rest dropped and
counted; at most ``MAX_SERIES_PER_FAMILY`` sensors (temperatures, power rails) per device in
``/metrics``. A real Jetson reports about 20 metrics (docs/fleet.md, Bounds). Pure.
"""

from typing import Any, Dict, Mapping, Tuple

MAX_TELEMETRY_KEYS = 64
MAX_KEY_CHARS = 64
MAX_SERIES_PER_FAMILY = 16

# Kept first when a device sends more than the cap: what the dashboard and /metrics show.
_SHOWN = ("cpu_percent", "gpu_percent", "emc_percent", "ram_fraction", "swap_fraction",
          "power_total_mw")


def _rank(key: str) -> Tuple[int, str]:
    if key in _SHOWN:
        return 0, key
    if key.startswith(("temp_", "power_")):
        return 1, key
    return 2, key


def cap_telemetry(msg: Mapping[str, Any]) -> Tuple[Dict[str, Any], int]:
    """``msg`` with at most MAX_TELEMETRY_KEYS numeric metrics, and how many were dropped
    (over the cap, a key too long, or a value that is not a number or null)."""
    metrics = msg.get("metrics")
    if not isinstance(metrics, Mapping):
        return dict(msg), 0
    fit = {k: v for k, v in metrics.items()
           if isinstance(k, str) and len(k) <= MAX_KEY_CHARS
           and (v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)))}
    kept = sorted(fit, key=_rank)[:MAX_TELEMETRY_KEYS]
    out = dict(msg)
    out["metrics"] = {k: fit[k] for k in sorted(kept)}
    return out, len(metrics) - len(kept)


def first(values: Mapping[str, float], limit: int = MAX_SERIES_PER_FAMILY
          ) -> Dict[str, float]:
    """The first ``limit`` entries by name (sensors of one device in one metric family)."""
    return {k: values[k] for k in sorted(values)[:limit]}
