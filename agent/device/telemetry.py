"""Device health for status reports: the jtop service when it answers, else Jetson sysfs, else the
plain host view.

``open_source(root)`` picks the best source once; ``source.sample()`` returns one flat dict and
is cheap (the daemon calls it every few seconds): paths are found when the source opens and
each sample reads a handful of small files (or jtop's already-synced stats). A jtop connection
that drops falls back to sysfs for good, with a problem line saying why.

Sample keys (all optional except ``source``; documented in docs/platform.md):
``cpu_percent``, ``ram_fraction``, ``swap_fraction``, ``gpu_percent``, ``emc_percent``,
``temp_<sensor>_c``, ``power_<rail>_mw``, ``power_total_mw``, ``nvpmodel``, ``jetson_clocks``.
"""

import glob
import os
import re
from typing import Any, Dict, List, Optional, Tuple

from agent.platform import (
    JtopFactory,
    Problem,
    connect_jtop,
    jtop_problem,
    load_matrix,
    looks_like_jetson,
)
from agent.platform.conditions import OFFLINE_TEMP_C, NvpModel, sensor_key
from agent.platform.conditions import number as _number
from agent.platform.conditions import read_text as _read
from agent.platform.conditions import thermal_zones as _thermal_zones

KINDS = ("jtop", "sysfs", "host")
# A rail with one of these names measures the whole board's input (jtop uses the same rule);
# otherwise the total is the sum of the rails.
TOTAL_RAILS = ("VIN", "POM_5V_IN", "VDD_IN")


def cpu_times(stat_text: str) -> Optional[Tuple[int, int]]:
    """(idle, total) jiffies from the aggregate ``cpu`` line of /proc/stat."""
    for line in stat_text.splitlines():
        if line.startswith("cpu "):
            values = [int(v) for v in line.split()[1:] if v.isdigit()]
            if len(values) < 4:
                return None
            idle = values[3] + (values[4] if len(values) > 4 else 0)
            return idle, sum(values[:8])
    return None


def memory_fractions(meminfo_text: str) -> Dict[str, float]:
    fields = {}
    for line in meminfo_text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[1].isdigit():
            fields[parts[0].rstrip(":")] = int(parts[1])
    out = {}
    total = fields.get("MemTotal")
    if total:
        avail = fields.get("MemAvailable", fields.get("MemFree", 0))
        out["ram_fraction"] = round((total - avail) / float(total), 4)
    swap = fields.get("SwapTotal")
    if swap is not None:
        out["swap_fraction"] = round((swap - fields.get("SwapFree", swap)) / float(swap), 4) \
            if swap else 0.0
    return out


class TelemetrySource(object):
    """One place health samples come from. ``kind`` is "jtop", "sysfs" or "host"; ``problems``
    lists {problem, fix} found while opening (or when jtop dropped)."""

    kind = "host"

    def __init__(self, root: str = "/") -> None:
        self.root = root
        self.problems: List[Problem] = []

    def sample(self) -> Dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> "TelemetrySource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _ProcReader(object):
    """CPU (delta between samples) and memory from /proc under a root."""

    def __init__(self, root: str) -> None:
        self.stat_path = os.path.join(root, "proc", "stat")
        self.meminfo_path = os.path.join(root, "proc", "meminfo")
        self.last = self._times()

    def _times(self) -> Optional[Tuple[int, int]]:
        text = _read(self.stat_path)
        return cpu_times(text) if text else None

    def sample(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        now = self._times()
        if now:
            idle, total = now
            if self.last and now[1] > self.last[1]:
                idle, total = now[0] - self.last[0], now[1] - self.last[1]
            # With no time elapsed (first sample right after opening) this is the since-boot
            # average, which is still the honest answer.
            out["cpu_percent"] = round(100.0 * (total - idle) / total, 1) if total else None
            self.last = now
        text = _read(self.meminfo_path)
        if text:
            out.update(memory_fractions(text))
        return out


def _power_rails(root: str) -> List[Tuple[str, Tuple[str, ...]]]:
    """(rail name, files): JetPack 5+ hwmon ina3221 (mV and mA files) or JetPack 4 iio
    (one mW file)."""
    rails: List[Tuple[str, Tuple[str, ...]]] = []
    for hw in sorted(glob.glob(os.path.join(root, "sys/class/hwmon/hwmon*"))):
        if (_read(os.path.join(hw, "name")) or "") not in ("ina3221", "ina238"):
            continue
        for label_path in sorted(glob.glob(os.path.join(hw, "in*_label"))):
            label = _read(label_path) or ""
            channel = os.path.basename(label_path)[2:-len("_label")]
            if not label or label == "NC" or label.startswith("sum of"):
                continue
            rails.append((label, (os.path.join(hw, "in{}_input".format(channel)),
                                  os.path.join(hw, "curr{}_input".format(channel)))))
    pattern = "sys/bus/i2c/drivers/ina3221x/*/iio:device*/rail_name_*"
    for name_path in sorted(glob.glob(os.path.join(root, pattern))):
        label = _read(name_path) or ""
        channel = name_path.rsplit("_", 1)[-1]
        if label:
            rails.append((label, (os.path.join(os.path.dirname(name_path),
                                               "in_power{}_input".format(channel)),)))
    return rails


def _gpu_load_file(root: str) -> Optional[str]:
    """The GPU's devfreq ``load`` (tenths of a percent)."""
    known = set()
    try:
        for soc in load_matrix().socs.values():
            known.update(soc["gpu_devfreq"])
    except Exception:  # noqa: BLE001 - a broken matrix must not stop telemetry
        pass
    base = os.path.join(root, "sys/class/devfreq")
    try:
        nodes = sorted(os.listdir(base))
    except OSError:
        nodes = []
    for node in nodes:
        of_name = _read(os.path.join(base, node, "device/of_node/name")) or ""
        if node in known or "gpu" in node or of_name in ("gpu", "gp10b", "gv11b", "ga10b"):
            for rel in ("device/load", "load"):
                path = os.path.join(base, node, rel)
                if os.path.isfile(path):
                    return path
    for rel in ("sys/devices/gpu.0/load", "sys/devices/platform/gpu.0/load"):
        path = os.path.join(root, rel)
        if os.path.isfile(path):
            return path
    return None


class SysfsSource(TelemetrySource):
    """Jetson without the jtop service: devfreq, thermal zones, INA3221 rails, nvpmodel."""

    kind = "sysfs"

    def __init__(self, root: str = "/") -> None:
        super(SysfsSource, self).__init__(root)
        self.proc = _ProcReader(root)
        self.gpu_load = _gpu_load_file(root)
        self.zones = _thermal_zones(root)
        self.rails = _power_rails(root)
        self.nvp = NvpModel(root)

    def sample(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"source": self.kind}
        out.update(self.proc.sample())
        load = _number(_read(self.gpu_load)) if self.gpu_load else None
        out["gpu_percent"] = round(load / 10.0, 1) if load is not None else None
        for key, path in self.zones:
            milli = _number(_read(path))
            if milli is not None and milli / 1000.0 > OFFLINE_TEMP_C:
                out[key] = round(milli / 1000.0, 1)
        rails = {}
        for label, files in self.rails:
            values = [_number(_read(f)) for f in files]
            if any(v is None for v in values):
                continue
            volts_or_mw, amps = values[0] or 0.0, values[-1] or 0.0
            mw = volts_or_mw if len(values) == 1 else volts_or_mw * amps / 1000.0
            rails[label] = int(round(mw or 0))
            out["power_{}_mw".format(sensor_key(label))] = rails[label]
        if rails:
            total = next((rails[n] for n in TOTAL_RAILS if n in rails), None)
            out["power_total_mw"] = total if total is not None else sum(rails.values())
        out["nvpmodel"] = self.nvp.current()
        out["jetson_clocks"] = None  # only the jtop service knows
        return out


class HostSource(TelemetrySource):
    """Any other machine: /proc where there is one (Linux, or a recorded tree), else psutil
    when installed, else only the source name."""

    kind = "host"

    def __init__(self, root: str = "/") -> None:
        super(HostSource, self).__init__(root)
        self.psutil: Any = None
        self.proc: Optional[_ProcReader] = None
        if root != "/" or os.path.isfile("/proc/stat"):
            self.proc = _ProcReader(root)
        elif root == "/":
            try:
                import psutil  # noqa: PLC0415 - optional dependency

                psutil.cpu_percent(interval=None)  # primes the delta
                self.psutil = psutil
            except ImportError:
                pass
        self.zones = _thermal_zones(root)

    def sample(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"source": self.kind}
        if self.proc is not None:
            out.update(self.proc.sample())
        elif self.psutil is not None:
            out["cpu_percent"] = round(self.psutil.cpu_percent(interval=None), 1)
            out["ram_fraction"] = round(self.psutil.virtual_memory().percent / 100.0, 4)
            out["swap_fraction"] = round(self.psutil.swap_memory().percent / 100.0, 4)
        for key, path in self.zones:
            milli = _number(_read(path))
            if milli is not None and milli / 1000.0 > OFFLINE_TEMP_C:
                out[key] = round(milli / 1000.0, 1)
        return out


def stats_to_sample(stats: Dict[str, Any]) -> Dict[str, Any]:
    """jtop's flat ``stats`` dict (jetson-stats 7.x) -> our sample keys."""
    out: Dict[str, Any] = {"source": "jtop"}
    cpus = [v for k, v in stats.items()
            if re.match(r"^CPU\d+$", str(k)) and isinstance(v, (int, float))]
    out["cpu_percent"] = round(sum(cpus) / float(len(cpus)), 1) if cpus else None
    for src, dst in (("RAM", "ram_fraction"), ("SWAP", "swap_fraction")):
        if isinstance(stats.get(src), (int, float)):
            out[dst] = round(float(stats[src]), 4)
    for src, dst in (("GPU", "gpu_percent"), ("EMC", "emc_percent")):
        if isinstance(stats.get(src), (int, float)):
            out[dst] = round(float(stats[src]), 1)
    for key, value in stats.items():
        key = str(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if key.startswith("Temp ") and value > OFFLINE_TEMP_C:
            out["temp_{}_c".format(sensor_key(key[5:]))] = round(float(value), 1)
        elif key == "Power TOT":
            out["power_total_mw"] = int(value)
        elif key.startswith("Power "):
            out["power_{}_mw".format(sensor_key(key[6:]))] = int(value)
    model = stats.get("nvp model", stats.get("nvpmodel"))
    out["nvpmodel"] = str(model) if model is not None else None
    clocks = stats.get("jetson_clocks")
    if isinstance(clocks, str):
        out["jetson_clocks"] = clocks.strip().upper() == "ON"
    else:
        out["jetson_clocks"] = bool(clocks) if clocks is not None else None
    return out


class JtopSource(TelemetrySource):
    """The jtop service (jetson-stats). Reads the client's synced stats without blocking; when
    the connection drops it records why and serves sysfs samples from then on."""

    kind = "jtop"

    def __init__(self, client: Any, root: str = "/") -> None:
        super(JtopSource, self).__init__(root)
        self.client = client
        self.fallback: Optional[SysfsSource] = None

    def sample(self) -> Dict[str, Any]:
        if self.fallback is not None:
            return self.fallback.sample()
        try:
            if not self.client.ok(spin=True):
                raise ConnectionRefusedError("Lost connection with jtop server")
            return stats_to_sample(dict(self.client.stats))
        except Exception as exc:  # noqa: BLE001 - any jtop failure means: fall back
            self.problems.append(jtop_problem(exc))
            self.close()
            self.fallback = SysfsSource(self.root)
            self.kind = self.fallback.kind
            return self.fallback.sample()

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a broken client must not fail
                pass


def open_source(root: str = "/", use_jtop: bool = True, jtop_factory: Optional[JtopFactory] = None,
                interval: float = 1.0) -> TelemetrySource:
    """The best telemetry source under ``root``: jtop service > Jetson sysfs > host. jtop is
    tried only on a Jetson, for the live system (root "/") or with an explicit
    ``jtop_factory``; when it cannot be used the reason is in ``source.problems``."""
    root = os.path.abspath(root)
    jetson = looks_like_jetson(root)
    problems: List[Problem] = []
    if jetson and use_jtop and (root == "/" or jtop_factory is not None):
        client, trouble = connect_jtop(jtop_factory, interval=interval)
        if client is not None:
            return JtopSource(client, root)
        if trouble:
            problems.append(trouble)
    source: TelemetrySource = SysfsSource(root) if jetson else HostSource(root)
    source.problems.extend(problems)
    return source
