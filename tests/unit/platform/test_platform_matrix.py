"""The support matrix: the packaged file lists every reference family and agrees with the
compute-capability rules, and a broken matrix file is an error naming the file and the key."""


import pytest
import yaml

from agent import platform as plat
from agent.errors import AgentError

REFERENCE_FAMILIES = ("nano", "tx1", "tx2", "xavier-nx", "agx-xavier", "orin-nano", "orin-nx",
                      "agx-orin", "thor")


# --------------------------------------------------------------------------- the matrix

def test_packaged_matrix_is_valid_and_lists_every_reference_family():
    matrix = plat.load_matrix()
    assert tuple(matrix.families) == REFERENCE_FAMILIES
    for fid in REFERENCE_FAMILIES:
        row = matrix.family_row(fid)
        assert set(row["precisions"]) == set(plat.PRECISIONS)
        assert row["precisions"]["fp32"] == "native"
    assert matrix.host_row()["precisions"] == {
        "fp32": "native", "tf32": "none", "fp16": "emulated", "bf16": "none",
        "int8": "emulated", "fp8": "none", "fp4": "none"}


def test_family_rows_agree_with_the_compute_capability_rules():
    """The hand-written rows and the CC rules must tell the same story (TX2 included)."""
    matrix = plat.load_matrix()
    for fid, fam in matrix.families.items():
        cc = matrix.socs[fam["soc"]]["compute_capability"]
        assert matrix.cc_precisions(cc) == fam["precisions"], fid


def test_tx2_int8_correction_is_recorded():
    row = plat.load_matrix().family_row("tx2")
    assert row["precisions"]["int8"] == "none"
    assert "torch2trt" in row["precision_notes"]["int8"]


@pytest.mark.parametrize("cc, native, missing", [
    ("6.1", ["fp32", "int8"], ["fp16", "tf32"]),
    ("6.2", ["fp32", "fp16"], ["int8"]),
    ("7.5", ["fp32", "fp16", "int8"], ["bf16", "tf32", "fp8"]),
    ("8.6", ["tf32", "bf16", "int8"], ["fp8", "fp4"]),
    ("8.9", ["fp8"], ["fp4"]),
    ("9.0", ["fp8"], ["fp4"]),
    ("12.0", ["fp8", "fp4"], []),
])
def test_cc_rules(cc, native, missing):
    levels = plat.load_matrix().cc_precisions(cc)
    assert all(levels[p] == "native" for p in native)
    assert all(levels[p] == "none" for p in missing)


def _write_matrix(tmp_path, edit):
    with open(plat.DEFAULT_MATRIX) as f:
        data = yaml.safe_load(f)
    edit(data)
    path = tmp_path / "support_matrix.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def _typo_key(data):
    data["families"]["nano"]["precison"] = data["families"]["nano"].pop("precisions")


def _unknown_precision(data):
    data["families"]["thor"]["precisions"]["fp6"] = "native"


def _yes_instead_of_native(data):
    data["families"]["orin-nano"]["precisions"]["int8"] = True  # what `int8: yes` parses to


def _unquoted_version(data):
    data["families"]["nano"]["jetpack"]["last"] = 4.6


def _unknown_soc(data):
    data["families"]["tx1"]["soc"] = "tegra211"


@pytest.mark.parametrize("edit, where, found", [
    (_typo_key, "families.nano", "precison"),
    (_unknown_precision, "families.thor.precisions", "fp6"),
    (_yes_instead_of_native, "families.orin-nano.precisions.int8", "True"),
    (_unquoted_version, "families.nano.jetpack.last", "4.6"),
    (_unknown_soc, "families.tx1.soc", "tegra211"),
])
def test_matrix_typos_name_the_file_and_what_was_expected(tmp_path, edit, where, found):
    path = _write_matrix(tmp_path, edit)
    with pytest.raises(AgentError) as err:
        plat.load_matrix(path)
    assert err.value.code == "bad_platform_data"
    assert path in err.value.message
    assert where in err.value.message and found in err.value.message
    assert "expected" in err.value.message


def test_matrix_yaml_syntax_error_names_the_file(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("families: {nano: [unclosed\n")
    with pytest.raises(AgentError) as err:
        plat.load_matrix(str(path))
    assert err.value.code == "bad_platform_data" and str(path) in err.value.message


def test_missing_matrix_file_is_an_agent_error(tmp_path):
    with pytest.raises(AgentError) as err:
        plat.load_matrix(str(tmp_path / "nope.yaml"))
    assert err.value.code == "bad_platform_data"
