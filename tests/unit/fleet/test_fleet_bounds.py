"""What a device may put in the registry is bounded (agent.fleet.admission.bounds)."""

from agent.fleet.admission import bounds


def test_telemetry_keeps_at_most_the_cap_the_shown_metrics_first():
    metrics = {"junk_{:04d}".format(i): float(i) for i in range(256)}
    metrics.update({"cpu_percent": 5.0, "temp_gpu_c": 40.0, "power_total_mw": 5000})
    msg, dropped = bounds.cap_telemetry({"device": "d", "ts": 1.0, "metrics": metrics})
    assert len(msg["metrics"]) == bounds.MAX_TELEMETRY_KEYS
    assert dropped == 259 - bounds.MAX_TELEMETRY_KEYS
    for key in ("cpu_percent", "temp_gpu_c", "power_total_mw"):
        assert key in msg["metrics"]


def test_long_keys_and_values_that_are_not_numbers_are_dropped_and_counted():
    metrics = {"k" * 65: 1.0, "text": "x" * 1000, "nested": {"a": 1}, "flag": True,
               "ok": 1.5, "missing": None}
    msg, dropped = bounds.cap_telemetry({"device": "d", "ts": 1.0, "metrics": metrics})
    assert msg["metrics"] == {"ok": 1.5, "missing": None} and dropped == 4


def test_a_real_jetsons_telemetry_is_kept_whole():
    metrics = {"cpu_percent": 12.5, "gpu_percent": 80.0, "emc_percent": 20.0,
               "ram_fraction": 0.5, "swap_fraction": 0.0, "power_total_mw": 15000}
    metrics.update({"temp_{}_c".format(z): 40.0 for z in ("cpu", "gpu", "soc0", "soc1",
                                                           "soc2", "tj", "cv0", "cv1")})
    metrics.update({"power_{}_mw".format(r): 1000 for r in ("vdd_gpu_soc", "vdd_cpu_cv",
                                                            "vin_sys_5v0")})
    msg, dropped = bounds.cap_telemetry({"device": "d", "ts": 1.0, "metrics": metrics})
    assert msg["metrics"] == metrics and dropped == 0
    assert len(bounds.first({"s{}".format(i): 1.0 for i in range(40)})) == 16
