"""Streaming calibration datasets (calib/dataset.py)."""

import base64
import io
import json
import tracemalloc

import numpy as np
import pytest

from agent.engines.backends.base import TensorSpec
from agent.errors import AgentError
from calib.dataset import CalibrationDataset

X = TensorSpec("x", np.float32, (None, 3))
MASK = TensorSpec("x_mask", np.int64, (None, 3))


def samples(n, start=0, cols=3, dtype=np.float32):
    """Rows whose first column is the sample number, so order can be checked."""
    a = np.zeros((n, cols), dtype=dtype)
    a[:, 0] = np.arange(start, start + n)
    return a


def rows(ds, name="x"):
    return [int(v) for batch in ds for v in batch[name][:, 0]]


def polygraphy_array(a):
    buf = io.BytesIO()
    np.save(buf, a)
    return {"array": base64.b64encode(buf.getvalue()).decode(), "polygraphy_class": "ndarray"}


def code_of(fn):
    with pytest.raises(AgentError) as err:
        fn()
    return err.value


def test_npy_shards_of_one_input_are_rebatched_in_order(tmp_path):
    np.save(str(tmp_path / "a.npy"), samples(5, 0))
    np.save(str(tmp_path / "b.npy"), samples(4, 5))
    ds = CalibrationDataset(str(tmp_path), [X], batch_size=4)
    assert ds.num_samples() == 9 and ds.num_batches() == 3
    sizes = [b["x"].shape[0] for b in ds]
    assert sizes == [4, 4, 1]
    assert rows(ds) == list(range(9))
    assert rows(ds) == list(range(9))  # a second pass gives the same stream


def test_npy_shards_named_after_inputs_with_prefixes(tmp_path):
    for k in range(3):
        np.save(str(tmp_path / "x_{:04d}.npy".format(k)), samples(2, 2 * k))
        np.save(str(tmp_path / "x_mask.{}.npy".format(k)), samples(2, 10 * k, dtype=np.int64))
    ds = CalibrationDataset(str(tmp_path), [X, MASK], batch_size=3)
    batches = list(ds)
    assert rows(ds) == list(range(6))
    assert rows(ds, "x_mask") == [0, 1, 10, 11, 20, 21]
    assert batches[0]["x_mask"].dtype == np.int64


def test_npz_shards_and_float64_is_cast(tmp_path):
    np.savez(str(tmp_path / "s0.npz"), x=samples(3, 0, dtype=np.float64))
    np.savez_compressed(str(tmp_path / "s1.npz"), x=samples(3, 3))
    ds = CalibrationDataset(str(tmp_path), [X], batch_size=2)
    batches = list(ds)
    assert all(b["x"].dtype == np.float32 for b in batches)
    assert rows(ds) == list(range(6))


def test_single_npz_and_single_npy(tmp_path):
    np.savez(str(tmp_path / "one.npz"), x=samples(7))
    assert CalibrationDataset(str(tmp_path / "one.npz"), [X], 3).num_batches() == 3
    np.save(str(tmp_path / "one.npy"), samples(7))
    assert rows(CalibrationDataset(str(tmp_path / "one.npy"), [X], 3)) == list(range(7))
    err = code_of(lambda: CalibrationDataset(str(tmp_path / "one.npy"), [X, MASK], 3))
    assert err.code == "bad_calibration_data"


def test_polygraphy_inputs_json(tmp_path):
    feeds = [{"x": polygraphy_array(samples(2, 2 * k))} for k in range(3)]
    path = tmp_path / "inputs.json"
    path.write_text(json.dumps(feeds))
    ds = CalibrationDataset(str(path), [X], batch_size=4)
    assert ds.num_samples() == 6
    assert rows(ds) == list(range(6))


def test_shuffle_is_seeded_and_complete(tmp_path):
    for k in range(4):
        np.save(str(tmp_path / "x_{}.npy".format(k)), samples(5, 5 * k))
    a = rows(CalibrationDataset(str(tmp_path), [X], 3, shuffle_seed=7))
    b = rows(CalibrationDataset(str(tmp_path), [X], 3, shuffle_seed=7))
    c = rows(CalibrationDataset(str(tmp_path), [X], 3, shuffle_seed=8))
    assert a == b and a != list(range(20)) and a != c
    assert sorted(a) == list(range(20))


def test_max_samples(tmp_path):
    np.save(str(tmp_path / "x.npy"), samples(10))
    ds = CalibrationDataset(str(tmp_path), [X], 4, max_samples=6)
    assert ds.num_samples() == 6 and ds.num_batches() == 2
    assert rows(ds) == list(range(6))
    shuffled = rows(CalibrationDataset(str(tmp_path), [X], 4, shuffle_seed=1, max_samples=6))
    assert len(shuffled) == 6 and len(set(shuffled)) == 6


def test_fixed_batch_dimension_drops_the_partial_batch(tmp_path):
    np.save(str(tmp_path / "x.npy"), samples(5))
    fixed = TensorSpec("x", np.float32, (2, 3))
    ds = CalibrationDataset(str(tmp_path), [fixed], 2)
    assert ds.num_batches() == 2 and [b["x"].shape[0] for b in ds] == [2, 2]
    err = code_of(lambda: CalibrationDataset(str(tmp_path), [fixed], 4))
    assert err.code == "bad_argument" and "fixed to 2" in err.message


def test_digest_tracks_content(tmp_path):
    np.save(str(tmp_path / "x.npy"), samples(4))
    d1 = CalibrationDataset(str(tmp_path), [X], 2).digest()
    assert d1 == CalibrationDataset(str(tmp_path), [X], 3).digest() and len(d1) == 64
    np.save(str(tmp_path / "x.npy"), samples(4, 1))
    assert CalibrationDataset(str(tmp_path), [X], 2).digest() != d1


def test_only_one_shard_is_in_memory(tmp_path):
    # 12 shards of 1 MB each: iterating must not hold them all.
    for k in range(12):
        np.savez(str(tmp_path / "s{:02d}.npz".format(k)), x=np.full((87381, 3), k, np.float32))
    ds = CalibrationDataset(str(tmp_path), [X], batch_size=4096)
    tracemalloc.start()
    try:
        total = 0
        for batch in ds:
            total += batch["x"].shape[0]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert total == 12 * 87381
    assert peak < 4 * 1024 * 1024  # about two shards' worth at most, never 12 MB


# -- bad input ---------------------------------------------------------------------------------

def test_wrong_shape_names_file_input_expected_and_found(tmp_path):
    np.save(str(tmp_path / "x.npy"), np.zeros((4, 5), np.float32))
    err = code_of(lambda: CalibrationDataset(str(tmp_path), [X], 2))
    assert err.code == "bad_calibration_data"
    for fragment in ("x.npy", "'x'", "[?, 3]", "[4, 5]"):
        assert fragment in err.message
    np.save(str(tmp_path / "x.npy"), np.zeros((4,), np.float32))
    err = code_of(lambda: CalibrationDataset(str(tmp_path), [X], 2))
    assert err.code == "bad_calibration_data" and "rank 2" in err.message


def test_wrong_dtype(tmp_path):
    np.save(str(tmp_path / "m.npy"), np.zeros((4, 3), np.float32))
    err = code_of(lambda: CalibrationDataset(str(tmp_path / "m.npy"), [MASK], 2))
    assert err.code == "bad_calibration_data"
    assert "int64" in err.message and "float32" in err.message
    np.save(str(tmp_path / "c.npy"), np.zeros((4, 3), np.complex64))
    assert code_of(lambda: CalibrationDataset(str(tmp_path / "c.npy"), [X], 2)).code == \
        "bad_calibration_data"


def test_wrong_and_missing_names(tmp_path):
    np.savez(str(tmp_path / "s.npz"), y=samples(2))
    err = code_of(lambda: CalibrationDataset(str(tmp_path / "s.npz"), [X], 2))
    assert err.code == "bad_calibration_data" and "'y'" in err.message and "s.npz" in err.message
    np.savez(str(tmp_path / "t.npz"), x=samples(2))
    err = code_of(lambda: CalibrationDataset(str(tmp_path / "t.npz"), [X, MASK], 2))
    assert err.code == "bad_calibration_data" and "'x_mask'" in err.message
    d = tmp_path / "npy"
    d.mkdir()
    np.save(str(d / "x.npy"), samples(2))
    np.save(str(d / "other.npy"), samples(2))
    err = code_of(lambda: CalibrationDataset(str(d), [X, MASK], 2))
    assert err.code == "bad_calibration_data" and "other.npy" in err.message


def test_sample_counts_must_agree_across_inputs(tmp_path):
    np.savez(str(tmp_path / "s.npz"), x=samples(2), x_mask=samples(3, dtype=np.int64))
    err = code_of(lambda: CalibrationDataset(str(tmp_path / "s.npz"), [X, MASK], 2))
    assert err.code == "bad_calibration_data" and "same number of samples" in err.message


def test_empty_datasets(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert code_of(lambda: CalibrationDataset(str(empty), [X], 2)).code == \
        "empty_calibration_data"
    np.save(str(tmp_path / "zero.npy"), np.zeros((0, 3), np.float32))
    assert code_of(lambda: CalibrationDataset(str(tmp_path / "zero.npy"), [X], 2)).code == \
        "empty_calibration_data"
    (tmp_path / "none.json").write_text("[]")
    assert code_of(lambda: CalibrationDataset(str(tmp_path / "none.json"), [X], 2)).code == \
        "empty_calibration_data"


def test_unreadable_inputs(tmp_path):
    assert code_of(lambda: CalibrationDataset(str(tmp_path / "nope"), [X], 2)).code == \
        "file_not_found"
    (tmp_path / "bad.npy").write_bytes(b"not numpy at all")
    err = code_of(lambda: CalibrationDataset(str(tmp_path / "bad.npy"), [X], 2))
    assert err.code == "bad_calibration_data" and "bad.npy" in err.message
    (tmp_path / "bad.json").write_text("{not json")
    assert code_of(lambda: CalibrationDataset(str(tmp_path / "bad.json"), [X], 2)).code == \
        "bad_calibration_data"
    (tmp_path / "outputs.json").write_text(json.dumps({"lst": [], "polygraphy_class": "x"}))
    err = code_of(lambda: CalibrationDataset(str(tmp_path / "outputs.json"), [X], 2))
    assert "save-outputs" in err.message
    (tmp_path / "data.txt").write_text("1 2 3")
    assert code_of(lambda: CalibrationDataset(str(tmp_path / "data.txt"), [X], 2)).code == \
        "bad_calibration_data"
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    np.save(str(mixed / "x.npy"), samples(2))
    np.savez(str(mixed / "s.npz"), x=samples(2))
    assert code_of(lambda: CalibrationDataset(str(mixed), [X], 2)).code == \
        "bad_calibration_data"
