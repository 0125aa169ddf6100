import base64
import io
import json

import numpy as np
import pytest

from agent.engines.backends.base import TensorSpec
from agent.errors import AgentError
from agent.precision import golden

X = TensorSpec("x", np.float32, (1, 1, 4, 4))
Y = TensorSpec("y", np.float32, (None, 4))


def b64(array):
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def test_polygraphy_inputs_json_round_trip(tmp_path):
    feeds = [{"x": np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)},
             {"x": np.ones((1, 1, 4, 4), np.float32)}]
    path = str(tmp_path / "inputs.json")
    golden.save_inputs(path, feeds)
    with open(path) as f:
        doc = json.load(f)
    # The exact shape of `polygraphy run --save-inputs`.
    assert isinstance(doc, list) and len(doc) == 2
    assert doc[0]["x"]["polygraphy_class"] == "ndarray"
    assert np.array_equal(np.load(io.BytesIO(base64.b64decode(doc[0]["x"]["array"]))),
                          feeds[0]["x"])
    loaded = golden.load_inputs(path)
    assert [list(f) for f in loaded] == [["x"], ["x"]]
    assert np.array_equal(loaded[1]["x"], feeds[1]["x"])


def test_polygraphy_outputs_json_round_trip(tmp_path):
    outs = [{"y": np.full((2, 4), 3.0, np.float32), "z": np.zeros(3, np.int64)}]
    path = str(tmp_path / "golden.json")
    golden.save_outputs(path, outs, runner="onnxrt-runner-N0", runtime=0.01)
    with open(path) as f:
        doc = json.load(f)
    assert doc["polygraphy_class"] == "RunResults"
    name, iterations = doc["lst"][0]
    assert name == "onnxrt-runner-N0"
    it = iterations[0]
    assert it["polygraphy_class"] == "IterationResult" and it["runner_name"] == name
    assert it["outputs"]["y"]["polygraphy_class"] == "LazyArray"
    assert it["outputs"]["y"]["values"]["polygraphy_class"] == "ndarray"
    loaded = golden.load_outputs(path)
    assert np.array_equal(loaded[0]["y"], outs[0]["y"]) and loaded[0]["z"].dtype == np.int64


def test_reads_older_polygraphy_encodings(tmp_path):
    # Legacy type markers, arrays stored directly as outputs (no LazyArray), two runners.
    arr = np.array([1.5, 2.5], np.float32)
    doc = {"lst": [
        ["trt-runner", [{"outputs": {"y": {"array": b64(arr),
                                           "__polygraphy_encoded_ndarray": "x"}},
                         "runtime": None, "runner_name": "trt-runner",
                         "__polygraphy_encoded_IterationResult": "x"}]],
        ["onnxrt-runner", [{"outputs": {"y": {"values": {"array": b64(arr * 2),
                                                         "polygraphy_class": "ndarray"},
                                              "polygraphy_class": "LazyNumpyArray"}},
                            "runtime": 0.1, "runner_name": "onnxrt-runner",
                            "polygraphy_class": "IterationResult"}]]],
        "polygraphy_class": "RunResults"}
    path = str(tmp_path / "old.json")
    with open(path, "w") as f:
        json.dump(doc, f)
    assert np.array_equal(golden.load_outputs(path)[0]["y"], arr)
    assert np.array_equal(golden.load_outputs(path, runner="onnxrt-runner")[0]["y"], arr * 2)
    assert [n for n, _ in golden.load_run_results(path)] == ["trt-runner", "onnxrt-runner"]
    with pytest.raises(AgentError) as err:
        golden.load_outputs(path, runner="nope")
    assert err.value.code == "golden_mismatch" and "trt-runner" in err.value.message


def test_npz_single_and_multiple_iterations(tmp_path):
    one = [{"x": np.zeros((1, 1, 4, 4), np.float32)}]
    path = str(tmp_path / "one.npz")
    golden.save_inputs(path, one)
    assert list(golden.load_inputs(path)[0]) == ["x"]
    two = one + [{"x": np.ones((1, 1, 4, 4), np.float32)}]
    path = str(tmp_path / "two.npz")
    golden.save_outputs(path, two)
    loaded = golden.load_outputs(path)
    assert len(loaded) == 2 and loaded[1]["x"].max() == 1.0


@pytest.mark.parametrize("content", [b"not json", b"{\"lst\": 3}", b"[1, 2]",
                                     b"[{\"x\": {\"array\": \"!!!\", "
                                     b"\"polygraphy_class\": \"ndarray\"}}]"])
def test_malformed_files(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(AgentError) as err:
        golden.load_inputs(str(path)) if content.startswith(b"[") else \
            golden.load_outputs(str(path))
    assert err.value.code == "bad_golden_file"


def test_missing_file(tmp_path):
    with pytest.raises(AgentError) as err:
        golden.load_inputs(str(tmp_path / "nope.json"))
    assert err.value.code == "file_not_found"


def test_generated_inputs_follow_polygraphys_data_loader():
    specs = [TensorSpec("x", np.float32, (2, None)), TensorSpec("ids", np.int32, (3,)),
             TensorSpec("mask", np.bool_, (2,))]
    feeds = golden.generate_inputs(specs, {"x": (1.0, 2.0), "": (0.0, 5.0)}, seed=5,
                                   iterations=2)
    for index, feed in enumerate(feeds):
        rng = np.random.RandomState(5 + index)
        x = (rng.random_sample(size=(2, 1)) * (2.0 - 1.0) + 1.0).astype(np.float32)
        ids = rng.randint(low=0, high=6, size=(3,), dtype=np.int32)
        mask = rng.randint(low=False, high=2, size=(2,), dtype=np.bool_)
        assert np.array_equal(feed["x"], x) and feed["x"].dtype == np.float32
        assert np.array_equal(feed["ids"], ids) and np.array_equal(feed["mask"], mask)
    default = golden.generate_inputs([X])[0]["x"]
    expected = np.random.RandomState(1).random_sample((1, 1, 4, 4)).astype(np.float32)
    assert np.array_equal(default, expected)  # range [0, 1], seed 1


def test_val_range_syntax():
    assert golden.parse_val_range(["x:[1,2]", "[0, 5]", "scope:in:[-1,1]"]) == {
        "x": (1.0, 2.0), "": (0.0, 5.0), "scope:in": (-1.0, 1.0)}
    for bad in (["x:1,2"], ["x:[2,1]"], ["x:[a,1]"], ["x:[1,inf]"]):
        with pytest.raises(AgentError) as err:
            golden.parse_val_range(bad)
        assert err.value.code == "bad_argument"
    with pytest.raises(AgentError) as err:
        golden.generate_inputs([X], {"nope": (0.0, 1.0)})
    assert err.value.code == "bad_argument" and "nope" in err.value.message


def test_input_validation():
    good = [{"x": np.zeros((1, 1, 4, 4), np.float32)}]
    golden.validate_inputs(good, [X])
    cases = [
        [{"y": np.zeros((1, 1, 4, 4), np.float32)}],  # name
        [{"x": np.zeros((1, 1, 4, 5), np.float32)}],  # shape
        [{"x": np.zeros((1, 1, 4, 4), np.float64)}],  # dtype
        [],
    ]
    for feeds in cases:
        with pytest.raises(AgentError) as err:
            golden.validate_inputs(feeds, [X])
        assert err.value.code == "golden_mismatch"
    with pytest.raises(AgentError) as err:
        golden.validate_inputs(cases[1], [X])
    assert "expected float32 (1, 1, 4, 4)" in err.value.message
    assert "found float32 (1, 1, 4, 5)" in err.value.message


def test_golden_validation():
    golden.validate_goldens([{"y": np.zeros((7, 4), np.float32)}], [Y], 1)  # dynamic batch
    nan = np.zeros((2, 4), np.float32)
    nan[0, 1] = np.nan
    cases = [
        ([{"z": np.zeros((2, 4), np.float32)}], 1, "not an output"),
        ([{"y": np.zeros((2, 5), np.float32)}], 1, "expected float32 (?, 4)"),
        ([{"y": np.zeros((2, 4), np.float16)}], 1, "found float16"),
        ([{"y": nan}], 1, "1 NaN"),
        ([{"y": np.zeros((2, 4), np.float32)}], 2, "expected 2 iteration"),
    ]
    for goldens, iterations, text in cases:
        with pytest.raises(AgentError) as err:
            golden.validate_goldens(goldens, [Y], iterations)
        assert err.value.code == "golden_mismatch"
        assert text in err.value.message, err.value.message
