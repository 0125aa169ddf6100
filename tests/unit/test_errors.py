import os
import re

import pytest

from agent.errors import CODES, AgentError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_unknown_code_is_a_programming_error():
    with pytest.raises(ValueError):
        AgentError("no_such_code", "x")


def test_to_dict_is_stable():
    err = AgentError("bad_model", "expected ONNX, found 12 bytes of text", {"path": "m.onnx"})
    assert err.to_dict() == {
        "code": "bad_model",
        "message": "expected ONNX, found 12 bytes of text",
        "details": {"path": "m.onnx"},
    }


def test_docs_list_every_code():
    with open(os.path.join(ROOT, "docs", "errors.md")) as f:
        documented = set(re.findall(r"^\| `([a-z_]+)` \|", f.read(), re.M))
    assert documented == set(CODES)


def test_every_code_used_in_the_code_is_registered():
    used = set()
    for top in ("agent", "calib"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(dirpath, name)) as f:
                        used |= set(re.findall(r'AgentError\(\s*"([a-z_0-9]+)"', f.read()))
    assert used <= set(CODES), used - set(CODES)
