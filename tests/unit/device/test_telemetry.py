"""Telemetry sources: Jetson sysfs from recorded trees, the jtop service through a stand-in
client with a recorded stats dict, and this machine's /proc."""

import os

from jtop import JtopException

from agent.device import telemetry
from tests.unit.platform.test_platform import FakeJtop, fixture, load_jtop_recording


def test_sysfs_nano_jetpack4_layout():
    source = telemetry.open_source(fixture("nano"))
    assert source.kind == "sysfs" and source.problems == []
    s = source.sample()
    assert s["source"] == "sysfs"
    assert s["gpu_percent"] == 12.3  # devfreq load is in tenths of a percent
    assert s["temp_cpu_c"] == 36.5 and s["temp_gpu_c"] == 35.0
    assert s["power_pom_5v_gpu_mw"] == 80
    assert s["power_total_mw"] == 2530  # the input rail, not the sum
    assert s["nvpmodel"] == "MAXN" and s["jetson_clocks"] is None
    assert 0.0 <= s["ram_fraction"] <= 1.0 and s["cpu_percent"] is not None
    source.close()


def test_sysfs_orin_hwmon_rails_and_offline_sensors():
    s = telemetry.open_source(fixture("orin-nano")).sample()
    assert s["power_vdd_in_mw"] == 5672  # 5064 mV x 1120 mA
    assert s["power_total_mw"] == 5672
    assert "temp_cv0_c" not in s  # offline sensor (-256 C)
    assert s["nvpmodel"] == "MAXN_SUPER"
    agx = telemetry.open_source(fixture("agx-orin")).sample()
    rails = [k for k in agx if k.startswith("power_") and k != "power_total_mw"]
    assert "power_nc_mw" not in agx and len(rails) == 4
    assert agx["power_total_mw"] == sum(agx[k] for k in rails)  # no input rail: the sum
    assert agx["gpu_percent"] == 23.5


def test_sysfs_thor_gpc_devfreq():
    assert telemetry.open_source(fixture("thor")).sample()["gpu_percent"] == 8.1


def test_jtop_stats_are_mapped_to_the_same_keys():
    source = telemetry.open_source(fixture("agx-orin"), jtop_factory=FakeJtop)
    assert source.kind == "jtop"
    s = source.sample()
    assert s["source"] == "jtop"
    assert s["cpu_percent"] == round((12 + 9 + 7 + 15 + 4 + 3 + 6 + 2) / 8.0, 1)  # OFF skipped
    assert (s["ram_fraction"], s["gpu_percent"], s["emc_percent"]) == (0.2314, 23.5, 7.0)
    assert s["temp_cpu_c"] == 48.5 and "temp_cv0_c" not in s
    assert s["power_vdd_gpu_soc_mw"] == 2780 and s["power_total_mw"] == 7399
    assert (s["nvpmodel"], s["jetson_clocks"]) == ("MAXN", False)
    sysfs = telemetry.open_source(fixture("agx-orin"), use_jtop=False).sample()
    shared = {"cpu_percent", "ram_fraction", "gpu_percent", "temp_cpu_c", "temp_gpu_c",
              "power_vdd_gpu_soc_mw", "power_total_mw", "nvpmodel", "jetson_clocks"}
    assert shared <= set(s) and shared <= set(sysfs)
    source.close()


def test_a_dropped_jtop_connection_falls_back_to_sysfs():
    fake = FakeJtop(drop_after=1)
    source = telemetry.open_source(fixture("agx-orin"), jtop_factory=lambda: fake)
    assert source.sample()["source"] == "jtop"
    second = source.sample()
    assert second["source"] == "sysfs" and source.kind == "sysfs"
    assert fake.closed
    assert source.problems[0]["fix"] == "sudo systemctl enable --now jtop"
    assert source.sample()["source"] == "sysfs"


def test_jtop_unavailable_uses_sysfs_and_says_why():
    error = JtopException("I can't access jtop.service.\nPlease logout or reboot this board.")
    source = telemetry.open_source(fixture("agx-orin"), jtop_factory=lambda: FakeJtop(fail=error))
    assert source.kind == "sysfs"
    assert "group jtop" in source.problems[0]["problem"]


def test_this_machine_host_source():
    source = telemetry.open_source("/", use_jtop=False)
    if source.kind != "host":
        return  # running on a Jetson: covered by the fixtures
    s = source.sample()
    assert s["source"] == "host"
    assert 0.0 <= s["ram_fraction"] <= 1.0
    assert s["cpu_percent"] is None or 0.0 <= s["cpu_percent"] <= 100.0


def test_host_source_on_a_recorded_tree_reads_its_proc():
    s = telemetry.open_source(fixture("dgpu")).sample()
    assert s["source"] == "host"
    assert s["ram_fraction"] == round((65799740 - 52100000) / 65799740.0, 4)


def test_stats_to_sample_handles_off_cores_and_missing_keys():
    stats = dict(load_jtop_recording()["stats"])
    for key in ("GPU", "EMC", "nvp model", "jetson_clocks"):
        del stats[key]
    stats["CPU1"] = "OFF"
    s = telemetry.stats_to_sample(stats)
    assert "gpu_percent" not in s and s["nvpmodel"] is None and s["jetson_clocks"] is None
    assert telemetry.stats_to_sample({"jetson_clocks": "ON"})["jetson_clocks"] is True


def test_sensor_keys_match_between_sysfs_and_jtop():
    assert telemetry.sensor_key("CPU-therm") == telemetry.sensor_key("cpu") == "cpu"
    assert telemetry.sensor_key("cpu-thermal") == "cpu"
    assert telemetry.sensor_key("VDD_GPU_SOC") == "vdd_gpu_soc"


def test_sample_reads_only_the_paths_found_at_open(tmp_path):
    """Paths are resolved once; a sensor that disappears later is simply skipped."""
    import shutil

    root = tmp_path / "orin"
    shutil.copytree(fixture("orin-nano"), str(root))
    source = telemetry.open_source(str(root))
    os.remove(str(root / "sys" / "class" / "thermal" / "thermal_zone0" / "temp"))
    s = source.sample()
    assert "temp_cpu_c" not in s and s["temp_gpu_c"] == 46.2
