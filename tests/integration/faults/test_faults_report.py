"""The fault suite's report (``suite.py``): this file's name sorts last in the directory, so
pytest runs it after every scenario of the suite."""

import json
import os

import pytest

from tests.integration.faults.suite import FAULTS, MUST_BE_ZERO, REPORT

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
    assert {key: REPORT[key] for key in MUST_BE_ZERO} == dict.fromkeys(MUST_BE_ZERO, 0)
