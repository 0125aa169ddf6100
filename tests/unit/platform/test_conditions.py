"""Power mode, clocks and temperatures recorded with results (issue 34, item 6), read from a
recorded Jetson sysfs tree (the hardware boundary), and the daemon's telemetry reading the
same files through the same readers."""

from agent.platform import conditions

NVPMODEL_CONF = """< POWER_MODEL ID=0 NAME=MAXN >
< POWER_MODEL ID=1 NAME=15W >
"""


def jetson_tree(root):
    files = {
        "var/lib/nvpmodel/status": "pmode:0001\n",
        "etc/nvpmodel.conf": NVPMODEL_CONF,
        "sys/class/devfreq/17000000.ga10b/cur_freq": "624750000\n",
        "sys/class/devfreq/17000000.ga10b/device/of_node/name": "ga10b\0",
        "sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq": "1497600\n",
        "sys/class/thermal/thermal_zone0/type": "cpu-thermal\n",
        "sys/class/thermal/thermal_zone0/temp": "45500\n",
        "sys/class/thermal/thermal_zone1/type": "gpu-thermal\n",
        "sys/class/thermal/thermal_zone1/temp": "44250\n",
        "sys/class/thermal/thermal_zone2/type": "CV0-thermal\n",
        "sys/class/thermal/thermal_zone2/temp": "-256000\n",  # offline
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


def test_snapshot_of_a_jetson(tmp_path):
    snap = conditions.snapshot(jetson_tree(tmp_path))
    assert snap == {"nvpmodel": "15W", "clocks_mhz": {"gpu": 624.8, "cpu0": 1497.6},
                    "temperatures_c": {"cpu": 45.5, "gpu": 44.2}}
    assert conditions.describe(snap) == ("power mode 15W, cpu0 1497.6 MHz, gpu 624.8 MHz, "
                                         "cpu 45.5 C, gpu 44.2 C")


def test_snapshot_of_a_machine_without_those_files(tmp_path):
    snap = conditions.snapshot(str(tmp_path))
    assert snap == {"nvpmodel": None, "clocks_mhz": {}, "temperatures_c": {}}
    assert conditions.describe(snap) == ""


def test_telemetry_reads_the_same_power_mode(tmp_path):
    from agent.device.telemetry import SysfsSource

    sample = SysfsSource(jetson_tree(tmp_path)).sample()
    assert sample["nvpmodel"] == "15W" and sample["temp_cpu_c"] == 45.5
