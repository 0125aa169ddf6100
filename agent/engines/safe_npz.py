"""NumPy .npy / .npz files from a job, read as hostile input.

``np.load`` trusts what a file declares: it allocates the array a header claims (10^12 rows
is a 4 TB allocation), and ``zipfile`` inflates a whole bzip2 chunk in one call whatever the
member says its size is (a few KB inflate to gigabytes). Here every header is read first and
bounded before any data is inflated:

- a .npy header is parsed from at most ``MAX_HEADER`` bytes, without pickles or object dtypes;
  the bytes it declares (shape x item size) must be what the file or member holds;
- a .npz member is inflated by our own loop (``zip_members``: stored, deflate, bzip2), in
  chunks, never past the size the archive declares for it; the CRC is checked at the end;
- the bytes all members of one artifact declare are capped (``limit_for``): a multiple of the
  artifact's size (``inflate_ratio``), at least ``inflate_min_bytes``, at most
  ``max_data_bytes``; the daemon sets them from its ``limits`` config (``configure``).

Errors are ``AgentError`` with the caller's code (``bad_golden_file``, ``bad_calibration_data``)
and the numbers. Worker side: Python 3.6.
"""

import ast
import io
import os
import struct
import zipfile
from collections import OrderedDict
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Tuple

import numpy as np

from agent.engines.zip_members import CHUNK, Member, list_members
from agent.errors import AgentError

MAGIC = b"\x93NUMPY"
MAX_HEADER = 10000  # numpy's own default max_header_size
MAX_DIMS = 64
MAX_MEMBERS = 4096
DEFAULTS = {"inflate_ratio": 32, "inflate_min_bytes": 64 << 20, "max_data_bytes": 1 << 30}
_limits = dict(DEFAULTS)


def configure(inflate_ratio: Optional[int] = None, inflate_min_bytes: Optional[int] = None,
              max_data_bytes: Optional[int] = None, **_ignored: Any) -> None:
    """Set the caps (the worker does this from the job spec's ``limits``); None keeps one."""
    for key, value in (("inflate_ratio", inflate_ratio),
                       ("inflate_min_bytes", inflate_min_bytes),
                       ("max_data_bytes", max_data_bytes)):
        if value is not None:
            _limits[key] = int(value)


def limit_for(size: int) -> int:
    """The most bytes an artifact of ``size`` bytes may inflate to."""
    return min(_limits["max_data_bytes"],
               max(_limits["inflate_min_bytes"], _limits["inflate_ratio"] * int(size)))


def max_data_bytes() -> int:
    return _limits["max_data_bytes"]


def _limit_text(size: int) -> str:
    return ("at most {:,} bytes for an artifact of {:,} bytes (limits.inflate_ratio {} x its "
            "size, at least limits.inflate_min_bytes {:,}, at most limits.max_data_bytes "
            "{:,})".format(limit_for(size), size, _limits["inflate_ratio"],
                           _limits["inflate_min_bytes"], _limits["max_data_bytes"]))


class NpyHeader(object):
    def __init__(self, shape: Tuple[int, ...], dtype: np.dtype, fortran: bool,
                 header_len: int) -> None:
        self.shape = shape
        self.dtype = dtype
        self.fortran = fortran
        self.header_len = header_len  # bytes before the data
        count = 1
        for d in shape:
            count *= d
        self.nbytes = count * dtype.itemsize  # Python ints: no overflow


def _describe(head: bytes) -> str:
    if head[:1] == b"\x80" or head[:1] in (b"(", b"]", b"}"):
        return "a Python pickle (refused: unpickling runs code)"
    if head.startswith(b"PK"):
        return "a zip archive"
    if not head:
        return "no data"
    return "bytes starting with {!r}".format(head[:8])


def read_header(read: Callable[[int], bytes], code: str, source: str) -> NpyHeader:
    """Parse a .npy header from ``read`` (a stream's read) without trusting its sizes."""
    head = read(8)
    if len(head) < 8 or not head.startswith(MAGIC):
        raise AgentError(code, "{}: expected NumPy .npy data, found {}".format(
            source, _describe(head)))
    major = head[6] if isinstance(head[6], int) else ord(head[6])
    if major == 1:
        raw = read(2)
        size_len = 2
    elif major in (2, 3):
        raw = read(4)
        size_len = 4
    else:
        raise AgentError(code, "{}: expected .npy format version 1, 2 or 3, found {}".format(
            source, major))
    if len(raw) != size_len:
        raise AgentError(code, "{}: .npy header is truncated".format(source))
    hlen = struct.unpack("<H" if size_len == 2 else "<I", raw)[0]
    if hlen > MAX_HEADER:
        raise AgentError(code, "{}: expected a .npy header of at most {} bytes, found one "
                         "declaring {:,}".format(source, MAX_HEADER, hlen))
    text = read(hlen)
    if len(text) != hlen:
        raise AgentError(code, "{}: .npy header is truncated".format(source))
    try:
        doc = ast.literal_eval(text.decode("utf-8" if major == 3 else "latin-1"))
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError,
            UnicodeDecodeError) as exc:
        raise AgentError(code, "{}: .npy header does not parse ({})".format(
            source, type(exc).__name__))
    if not isinstance(doc, dict) or set(doc) != {"descr", "fortran_order", "shape"}:
        raise AgentError(code, "{}: expected a .npy header with descr, fortran_order and "
                         "shape, found {}".format(source, str(doc)[:200]))
    shape = doc["shape"]
    if not isinstance(shape, tuple) or len(shape) > MAX_DIMS or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise AgentError(code, "{}: expected a shape of at most {} non-negative integers, "
                         "found {}".format(source, MAX_DIMS, str(shape)[:200]))
    try:
        descr = doc["descr"]
        dtype = np.lib.format.descr_to_dtype(descr) if hasattr(
            np.lib.format, "descr_to_dtype") else np.dtype(descr)
    except (TypeError, ValueError, KeyError, IndexError, RecursionError) as exc:
        raise AgentError(code, "{}: .npy header names dtype {} that numpy does not know "
                         "({})".format(source, str(doc["descr"])[:100], exc))
    if dtype.hasobject:
        raise AgentError(code, "{}: expected numeric arrays, found dtype {} holding Python "
                         "objects (pickles are refused: unpickling runs code)".format(
                             source, dtype))
    return NpyHeader(tuple(shape), dtype, bool(doc["fortran_order"]), 8 + size_len + hlen)


def _fill(read: Callable[[int], bytes], header: NpyHeader, code: str,
          source: str) -> np.ndarray:
    """The array after ``header``, read in chunks into one buffer of the declared size."""
    buf = np.empty(header.nbytes, dtype=np.uint8)
    view = memoryview(buf)  # type: ignore[arg-type]
    done = 0
    while done < header.nbytes:
        piece = read(min(CHUNK, header.nbytes - done))
        if not piece:
            raise AgentError(code, "{}: header declares {:,} bytes of data, found {:,}".format(
                source, header.nbytes, done))
        view[done:done + len(piece)] = piece
        done += len(piece)
    if header.dtype.itemsize == 0:
        return np.empty(header.shape, dtype=header.dtype)
    return buf.view(header.dtype).reshape(header.shape, order="F" if header.fortran else "C")


def _too_big(code: str, source: str, header: NpyHeader, size: int) -> AgentError:
    return AgentError(code, "{}: header declares shape {} of {} = {:,} bytes; {}".format(
        source, list(header.shape), header.dtype, header.nbytes, _limit_text(size)),
        {"declared_bytes": header.nbytes, "limit_bytes": limit_for(size),
         "artifact_bytes": size})


def read_npy_bytes(raw: bytes, code: str, source: str,
                   budget_size: Optional[int] = None) -> np.ndarray:
    """An array from np.save bytes (e.g. base64 inside Polygraphy JSON); ``budget_size`` is
    the size of the file they came from (its inflate limit applies)."""
    stream = io.BytesIO(raw)
    header = read_header(stream.read, code, source)
    if header.nbytes > limit_for(budget_size or len(raw)):
        raise _too_big(code, source, header, budget_size or len(raw))
    if header.header_len + header.nbytes != len(raw):
        raise AgentError(code, "{}: header declares shape {} of {} = {:,} bytes of data, found "
                         "{:,}".format(source, list(header.shape), header.dtype, header.nbytes,
                                       len(raw) - header.header_len))
    return _fill(stream.read, header, code, source)


def npy_file_header(path: str, code: str, source: Optional[str] = None) -> NpyHeader:
    """The header of a .npy file, checked against the file's size (data is never inflated:
    a .npy holds exactly what it declares)."""
    source = source or path
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header = read_header(f.read, code, source)
    if header.header_len + header.nbytes != size:
        raise AgentError(code, "{}: header declares shape {} of {} = {:,} bytes of data; the "
                         "file holds {:,}".format(source, list(header.shape), header.dtype,
                                                  header.nbytes, size - header.header_len),
                         {"declared_bytes": header.nbytes,
                          "file_bytes": size - header.header_len})
    return header


def read_npy(path: str, code: str, source: Optional[str] = None,
             mmap: bool = False) -> np.ndarray:
    header = npy_file_header(path, code, source)
    if mmap and header.nbytes:
        return np.memmap(path, dtype=header.dtype, mode="r", offset=header.header_len,
                         shape=header.shape, order="F" if header.fortran else "C")
    with open(path, "rb") as f:
        f.seek(header.header_len)
        return _fill(f.read, header, code, source or path)


class NpzHeaders(object):
    """The members of an .npz, headers read and bounded; ``arrays()`` inflates them."""

    def __init__(self, path: str, code: str, source: Optional[str] = None,
                 skip_other: bool = False, fileobj: Optional[BinaryIO] = None,
                 budget_size: Optional[int] = None) -> None:
        self.path, self.code = path, code
        self.source = source or path
        self.fileobj = fileobj
        with self._open() as f:
            f.seek(0, os.SEEK_END)
            self.size = f.tell()
            budget = limit_for(budget_size or self.size)
            self.headers: Dict[str, Tuple[zipfile.ZipInfo, NpyHeader]] = OrderedDict()
            total = 0
            for info in list_members(f, code, self.source, self.size, MAX_MEMBERS):
                if info.is_dir():
                    continue
                if not info.filename.endswith(".npy"):
                    if skip_other:
                        continue
                    raise AgentError(code, "{}: expected .npy members, found {!r}".format(
                        self.source, info.filename))
                what = "{} member {!r}".format(self.source, info.filename)
                header = read_header(Member(f, info, code, self.source, self.size).read, code,
                                     what)
                if header.header_len + header.nbytes != info.file_size:
                    raise AgentError(code, "{}: header declares shape {} of {} = {:,} bytes; "
                                     "the archive says the member holds {:,}".format(
                                         what, list(header.shape), header.dtype, header.nbytes,
                                         info.file_size - header.header_len),
                                     {"declared_bytes": header.nbytes,
                                      "member_bytes": info.file_size})
                total += header.nbytes
                if total > budget:
                    raise AgentError(code, "{}: arrays declare {:,} bytes in all (this one: "
                                     "shape {} of {}); {}".format(
                                         what, total, list(header.shape), header.dtype,
                                         _limit_text(budget_size or self.size)),
                                     {"declared_bytes": total, "limit_bytes": budget,
                                      "artifact_bytes": budget_size or self.size})
                self.headers[info.filename[:-4]] = (info, header)
        self.total_bytes = total

    def _open(self) -> Any:
        if self.fileobj is not None:
            return _Borrowed(self.fileobj)
        return open(self.path, "rb")

    def arrays(self, names: Optional[List[str]] = None) -> "OrderedDict[str, np.ndarray]":
        out: "OrderedDict[str, np.ndarray]" = OrderedDict()
        with self._open() as f:
            for name, (info, header) in self.headers.items():
                if names is not None and name not in names:
                    continue
                member = Member(f, info, self.code, self.source, self.size)
                what = "{} member {!r}".format(self.source, info.filename)
                member.read(header.header_len)
                out[name] = _fill(member.read, header, self.code, what)
                member.finish()
        return out


class _Borrowed(object):
    """A caller's file object as a context manager that does not close it."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def __enter__(self) -> BinaryIO:
        return self.f

    def __exit__(self, *exc: Any) -> None:
        return None


def read_npz(path: str, code: str, source: Optional[str] = None) -> "OrderedDict[str, np.ndarray]":
    return NpzHeaders(path, code, source).arrays()


def read_npz_bytes(raw: bytes, code: str, source: str,
                   budget_size: Optional[int] = None) -> "OrderedDict[str, np.ndarray]":
    return NpzHeaders(source, code, source, fileobj=io.BytesIO(raw),
                      budget_size=budget_size).arrays()


def read_arrays(path: str, code: str, source: Optional[str] = None) -> List[np.ndarray]:
    """The arrays of a .npy or .npz file (decided by its first bytes)."""
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(b"PK"):
        return list(read_npz(path, code, source).values())
    return [read_npy(path, code, source)]

