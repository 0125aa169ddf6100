"""Hostile NumPy archives for the tests: decompression bombs and lying headers, built in memory
from crafted zip records (never by inflating anything)."""

import bz2
import os
import struct
import zlib

import numpy as np

MIB = 1 << 20


def npy_header(shape, dtype="<f4"):
    """The bytes np.save writes before the data of an array of ``shape``."""
    text = "{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}".format(
        dtype, repr(tuple(shape)))
    pad = 64 - (10 + len(text) + 1) % 64
    text = text + " " * pad + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin-1")


def deflate_zeros(prefix, total):
    """Raw deflate of ``prefix`` followed by zeros up to ``total`` bytes (a multiple of 1 MiB),
    built from one compressed MiB repeated: full flushes make each copy independent."""
    assert total % MIB == 0 and len(prefix) < MIB
    first = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = first.compress(prefix + b"\0" * (MIB - len(prefix))) + first.flush(zlib.Z_FULL_FLUSH)
    again = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = again.compress(b"\0" * MIB) + again.flush(zlib.Z_FULL_FLUSH)
    return head + block * (total // MIB - 1) + b"\x03\x00"  # an empty final block


def bzip2_zeros(prefix, total):
    """bzip2 of ``prefix`` followed by zeros up to ``total`` bytes (one stream)."""
    return bz2.compress(prefix + b"\0" * (total - len(prefix)), 9)


def write_zip(path, members):
    """members: (name, method, compressed bytes, declared inflated size, crc). Sizes of 4 GiB
    and more get ZIP64 records, as a real archiver writes them."""
    body = b""
    central = b""
    for name, method, data, size, crc in members:
        name_b = name.encode()
        offset = len(body)
        big = size >= 0xFFFFFFFF
        extra = struct.pack("<HHQQ", 1, 16, size, len(data)) if big else b""
        usize32, csize32 = (0xFFFFFFFF, 0xFFFFFFFF) if big else (size, len(data))
        version = 45 if big else 20
        body += struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", version, 0, method, 0, 0x21,
                            crc, csize32, usize32, len(name_b), len(extra)) + name_b + extra
        body += data
        central += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", version, version, 0,
                               method, 0, 0x21, crc, csize32, usize32, len(name_b), len(extra),
                               0, 0, 0, 0, offset) + name_b + extra
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(members), len(members),
                      len(central), len(body), 0)
    with open(str(path), "wb") as f:
        f.write(body + central + end)
    return str(path)


def deflate_bomb(path, name="logits", total=2048 * MIB, honest=True):
    """An .npz whose one float32 member inflates to ``total`` bytes (about total/1000 on
    disk); ``honest=False`` makes the archive and the header declare 64 bytes instead."""
    count = (total - 128) // 4 if honest else 16
    header = npy_header((count,))
    data = deflate_zeros(header, total)
    size = len(header) + count * 4
    return write_zip(path, [(name + ".npy", 8, data, size, 0)])


def bzip2_bomb(path, name="logits", declared=8 << 30, actual=64 * MIB, honest=True):
    """An .npz with one bzip2 member: the header and the archive declare ``declared`` bytes
    (8 GiB) when honest, else 64 bytes; the stream itself inflates to ``actual`` bytes."""
    count = declared // 4 if honest else 16
    header = npy_header((count,))
    data = bzip2_zeros(header, actual)
    return write_zip(path, [(name + ".npy", 12, data, len(header) + count * 4, 0)])


def lying_rows(path, name="input", rows=10 ** 12, row=(1, 8, 8)):
    """A stored .npz member whose header claims ``rows`` samples but holds one."""
    header = npy_header((rows,) + tuple(row))
    data = header + np.zeros((1,) + tuple(row), np.float32).tobytes()
    return write_zip(path, [(name + ".npy", 0, data, len(data), zlib.crc32(data))])


# -- ONNX models whose tensors keep their bytes in other files ----------------------------------

def _external(name, values, location, offsets):
    from onnx import TensorProto, numpy_helper

    tensor = numpy_helper.from_array(values, name)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    offset = offsets.get(location, 0)
    offsets[location] = offset + values.nbytes
    for key, value in (("location", location), ("offset", str(offset)),
                       ("length", str(values.nbytes))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor, values.tobytes()


def external_data_model(folder, locations=None, inline_others=False):
    """model.onnx in ``folder``: y = x + 1 + [0, 2, 0, 2] + 10 + 100 + 10000 with every constant
    kept outside: a top-level initializer, a sparse initializer, a Constant attribute, a
    Constant in an If's then-branch, an initializer of its else-branch and one in a Loop body.
    ``locations`` maps those (w, s, c, t, e, b) to file names (default weights.bin, or inside
    the model with ``inline_others``); the bytes go to the files named (where the folder
    allows). Returns (model path, {location: bytes})."""
    from onnx import TensorProto, helper, numpy_helper

    where = dict({k: "weights.bin" for k in "wsctbe"}, **(locations or {}))
    offsets, blobs = {}, {}

    def ext(key, name, values):
        if inline_others and key not in (locations or {}):
            return numpy_helper.from_array(np.asarray(values), name)
        tensor, data = _external(name, np.asarray(values), where[key], offsets)
        blobs[where[key]] = blobs.get(where[key], b"") + data
        return tensor

    f4 = np.float32
    vec = [4]
    w = ext("w", "W", np.ones(4, f4))
    s_values = ext("s", "S", np.full(2, 2, f4))
    sparse = helper.make_sparse_tensor(s_values, helper.make_tensor("S_idx", TensorProto.INT64,
                                                                     [2], [1, 3]), [4])
    c = helper.make_node("Constant", [], ["c"], name="const_c",
                         value=ext("c", "C", np.full(4, 10, f4)))
    then_g = helper.make_graph(
        [helper.make_node("Constant", [], ["t"], name="const_t",
                          value=ext("t", "T", np.full(4, 100, f4)))],
        "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, vec)])
    else_g = helper.make_graph(
        [helper.make_node("Identity", ["E"], ["e"], name="id_e")], "else", [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, vec)],
        initializer=[ext("e", "E", np.full(4, 1000, f4))])
    body = helper.make_graph(
        [helper.make_node("Add", ["v", "B"], ["v_out"], name="body_add"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v", TensorProto.FLOAT, vec)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, vec)],
        initializer=[ext("b", "B", np.full(4, 10000, f4))])
    nodes = [
        helper.make_node("Add", ["x", "W"], ["a1"], name="add_w"),
        helper.make_node("Add", ["a1", "S"], ["a2"], name="add_s"),
        c,
        helper.make_node("Add", ["a2", "c"], ["a3"], name="add_c"),
        helper.make_node("If", ["cond"], ["branch"], name="if", then_branch=then_g,
                         else_branch=else_g),
        helper.make_node("Add", ["a3", "branch"], ["a4"], name="add_if"),
        helper.make_node("Loop", ["M", "cond", "a4"], ["y"], name="loop", body=body),
    ]
    graph = helper.make_graph(
        nodes, "external", [helper.make_tensor_value_info("x", TensorProto.FLOAT, vec)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, vec)],
        initializer=[w, helper.make_tensor("cond", TensorProto.BOOL, [], [True]),
                     helper.make_tensor("M", TensorProto.INT64, [], [1])],
        sparse_initializer=[sparse])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    os.makedirs(str(folder), exist_ok=True)
    path = os.path.join(str(folder), "model.onnx")
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    for location, data in blobs.items():
        target = os.path.join(str(folder), location)
        if os.path.isdir(os.path.dirname(os.path.abspath(target))) and not os.path.exists(
                target):
            with open(target, "wb") as f:
                f.write(data)
    return path, blobs


EXTERNAL_EXPECTED_OFFSET = np.array([10111, 10113, 10111, 10113], np.float32)
