"""Hostile NumPy archives for the tests: decompression bombs and lying headers, built in memory
from crafted zip records (never by inflating anything)."""

import bz2
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
