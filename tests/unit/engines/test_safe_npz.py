"""agent.engines.safe_npz: headers and declared sizes are read before anything is inflated; bombs,
lying headers, pickles and object arrays are refused with the caller's code and the numbers,
with little memory spent."""

import io
import pickle
import tracemalloc

import numpy as np
import pytest

from agent.engines import safe_npz
from agent.errors import AgentError
from tests import bombs

CODE = "bad_golden_file"


def refused(fn, *args, **kwargs):
    with pytest.raises(AgentError) as info:
        fn(*args, **kwargs)
    assert info.value.code == CODE
    return info.value


def peak_while(fn):
    tracemalloc.start()
    try:
        fn()
    except AgentError:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


@pytest.fixture(autouse=True)
def default_limits():
    safe_npz.configure(**safe_npz.DEFAULTS)
    yield
    safe_npz.configure(**safe_npz.DEFAULTS)


def test_round_trip_of_what_numpy_writes(tmp_path):
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4),
              "f": np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3)),
              "h": np.ones((2, 2), np.float16), "b": np.array([True, False]),
              "s": np.float64(3.5), "e": np.zeros((0, 4), np.float32),
              "big": np.dtype(">i4").type(7) * np.ones(5, ">i4")}
    for save in (np.savez, np.savez_compressed):
        path = str(tmp_path / "x.npz")
        save(path, **arrays)
        got = safe_npz.read_npz(path, CODE)
        assert list(got) == list(arrays)
        for name, value in arrays.items():
            np.testing.assert_array_equal(got[name], value)
            assert got[name].dtype == np.asarray(value).dtype
    np.save(str(tmp_path / "y.npy"), arrays["f"])
    np.testing.assert_array_equal(safe_npz.read_npy(str(tmp_path / "y.npy"), CODE), arrays["f"])
    buf = io.BytesIO()
    np.save(buf, arrays["a"])
    np.testing.assert_array_equal(safe_npz.read_npy_bytes(buf.getvalue(), CODE, "b64"),
                                  arrays["a"])


def test_deflate_bomb_declaring_its_size_is_refused_from_the_header(tmp_path):
    path = bombs.deflate_bomb(tmp_path / "goldens.npz", total=2048 * bombs.MIB)
    err = refused(safe_npz.read_npz, path, CODE)
    assert "2,147,483,520 bytes" in err.message and "inflate_ratio" in err.message
    assert err.details["limit_bytes"] == safe_npz.limit_for(err.details["artifact_bytes"])
    assert peak_while(lambda: safe_npz.read_npz(path, CODE)) < 8 * bombs.MIB


def test_deflate_bomb_lying_about_its_size_stops_at_the_declared_size(tmp_path):
    path = bombs.deflate_bomb(tmp_path / "goldens.npz", total=256 * bombs.MIB, honest=False)
    err = refused(safe_npz.read_npz, path, CODE)
    assert "inflates to more than the 192 bytes it declares" in err.message
    assert peak_while(lambda: safe_npz.read_npz(path, CODE)) < 8 * bombs.MIB


def test_bzip2_bomb_declaring_8_gib_is_refused_before_inflating(tmp_path):
    path = bombs.bzip2_bomb(tmp_path / "calib.npz", actual=4 * bombs.MIB)
    err = refused(safe_npz.read_npz, path, CODE)
    assert "8,589,934,592 bytes" in err.message


def test_bzip2_member_inflating_past_its_declared_size_is_cut_short(tmp_path):
    # zipfile would inflate the whole 64 MiB stream in one call; the reader asks for 1 MiB.
    path = bombs.bzip2_bomb(tmp_path / "calib.npz", honest=False, actual=64 * bombs.MIB)
    err = refused(safe_npz.read_npz, path, CODE)
    assert "inflates to more than" in err.message
    assert peak_while(lambda: safe_npz.read_npz(path, CODE)) < 8 * bombs.MIB


def test_headers_claiming_rows_that_are_not_there(tmp_path):
    path = bombs.lying_rows(tmp_path / "inputs.npz")
    err = refused(safe_npz.read_npz, path, CODE)
    assert "shape [1000000000000, 1, 8, 8]" in err.message and "holds 256" in err.message
    npy = tmp_path / "labels.npy"
    npy.write_bytes(bombs.npy_header((10 ** 12,), "<i8") + b"\0" * 16)
    err = refused(safe_npz.read_npy, str(npy), CODE)
    assert "8,000,000,000,000 bytes" in err.message
    err = refused(safe_npz.read_npy_bytes, npy.read_bytes(), CODE, "inputs.json 'x'")
    assert "8,000,000,000,000 bytes" in err.message


def test_pickles_and_object_arrays_are_refused(tmp_path):
    pkl = tmp_path / "labels.npy"
    pkl.write_bytes(pickle.dumps([1, 2, 3]))
    assert "pickle" in refused(safe_npz.read_npy, str(pkl), CODE).message
    obj = tmp_path / "obj.npy"
    np.save(str(obj), np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    assert "Python objects" in refused(safe_npz.read_npy, str(obj), CODE).message
    npz = tmp_path / "obj.npz"
    np.savez(str(npz), x=np.array([1, "a"], dtype=object))
    assert "Python objects" in refused(safe_npz.read_npz, str(npz), CODE).message


def test_odd_headers_and_archives(tmp_path):
    long_header = tmp_path / "long.npy"
    long_header.write_bytes(b"\x93NUMPY\x02\x00" + (10 ** 6).to_bytes(4, "little") + b" " * 64)
    assert "at most 10000 bytes" in refused(safe_npz.read_npy, str(long_header), CODE).message
    nested = tmp_path / "nested.npy"
    text = b"{'descr': " + b"[" * 4900 + b"]" * 4900 + b"}"
    nested.write_bytes(b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text)
    assert "does not parse" in refused(safe_npz.read_npy, str(nested), CODE).message
    many = [("m{}.npy".format(i), 0, b"", 0, 0) for i in range(safe_npz.MAX_MEMBERS + 1)]
    path = bombs.write_zip(tmp_path / "many.npz", many)
    assert "at most 4096 arrays" in refused(safe_npz.read_npz, path, CODE).message
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    refused(safe_npz.read_npz, str(junk), CODE)


def test_limits_are_a_multiple_of_the_size_with_a_floor_and_a_ceiling(tmp_path):
    safe_npz.configure(inflate_ratio=4, inflate_min_bytes=1000, max_data_bytes=10 ** 6)
    assert safe_npz.limit_for(10) == 1000
    assert safe_npz.limit_for(10 ** 4) == 4 * 10 ** 4
    assert safe_npz.limit_for(10 ** 9) == 10 ** 6
    path = str(tmp_path / "z.npz")
    np.savez_compressed(path, x=np.zeros(10 ** 4, np.float32))  # 40 kB in a few hundred bytes
    err = refused(safe_npz.read_npz, path, CODE)
    assert "40,000 bytes" in err.message and "inflate_ratio 4 x" in err.message
    assert err.details["limit_bytes"] < 40000
