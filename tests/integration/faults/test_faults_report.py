"""The fault suite's report (``suite.py``): this file's name sorts last in the directory, so
pytest runs it after every scenario of the suite."""

import json
import os

import pytest

from tests.integration.faults.suite import FAULTS, REPORT

# ---------------------------------------------------------------------------- the report

def test_report():
    """Runs last (pytest runs the files in name order): prints the figures and asserts the
    zeros."""
    report = dict(REPORT)
    report["faults_by_kind"] = dict(sorted(FAULTS.items()))
    text = json.dumps(report, indent=2)
    print("\nfault suite report:\n" + text)
    out = os.environ.get("JETSON_AGENT_FAULT_REPORT")
    if out:
        with open(out, "w") as f:
            f.write(text)
    if not REPORT["runs"]:
        pytest.skip("no scenario ran")
    assert REPORT["data_lost"] == 0
    assert REPORT["corrupt_cache_entries"] == 0
    assert REPORT["daemon_crashes"] == 0
    assert REPORT["unexpected_errors"] == 0
    assert REPORT["devices_out_of_service"] == 0
