"""Zip members (the inside of an .npz) read as hostile input, without numpy.

``zipfile`` inflates a whole bzip2 chunk in one call whatever size the member declares (a few
KB inflate to gigabytes). ``Member`` inflates with our own loop instead (stored, deflate,
bzip2), a chunk at a time, never past the size the archive's directory declares, and checks
the CRC at the end; ``list_members`` bounds how many entries a directory may declare. Apart
from ``safe_npz`` because this is the zip format's part of the job, the .npy format is the rest.

Errors are ``AgentError`` with the caller's code. Worker side: Python 3.6.
"""

import bz2
import struct
import zipfile
import zlib
from typing import Any, BinaryIO, List

from agent.errors import AgentError

CHUNK = 256 << 10  # bytes inflated (and read) per step


class Member(object):
    """A bounded reader of one zip member: never yields more than the size the central
    directory declares (bzip2 and deflate are inflated with a max_length)."""

    def __init__(self, f: BinaryIO, info: zipfile.ZipInfo, code: str, source: str,
                 file_size: int) -> None:
        self.info, self.code, self.source = info, code, source
        if info.flag_bits & 0x1:
            raise AgentError(code, "{}: member {!r} is encrypted".format(source, info.filename))
        f.seek(info.header_offset)
        local = f.read(30)
        if len(local) != 30 or local[:4] != b"PK\x03\x04":
            raise AgentError(code, "{}: member {!r} has no local header where the directory "
                             "says".format(source, info.filename))
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        start = info.header_offset + 30 + name_len + extra_len
        if start + info.compress_size > file_size:
            raise AgentError(code, "{}: member {!r} declares {:,} compressed bytes past the end "
                             "of the archive".format(source, info.filename, info.compress_size))
        f.seek(start)
        self.f = f
        self.compressed_left = info.compress_size
        self.left = info.file_size  # inflated bytes still allowed
        self.crc = 0
        if info.compress_type == zipfile.ZIP_STORED:
            self.dec: Any = None
        elif info.compress_type == zipfile.ZIP_DEFLATED:
            self.dec = zlib.decompressobj(-15)
        elif info.compress_type == zipfile.ZIP_BZIP2:
            self.dec = bz2.BZ2Decompressor()
        else:
            raise AgentError(code, "{}: member {!r} uses compression method {}; expected stored, "
                             "deflate or bzip2".format(source, info.filename,
                                                       info.compress_type))

    def _raw(self) -> bytes:
        data = self.f.read(min(CHUNK, self.compressed_left))
        self.compressed_left -= len(data)
        return data

    def _inflate(self, want: int) -> bytes:
        """Up to ``want`` more inflated bytes (b"" at the end of the member)."""
        if self.dec is None:
            data = self.f.read(min(want, self.compressed_left))
            self.compressed_left -= len(data)
            return data
        out = b""
        while not out:
            if isinstance(self.dec, bz2.BZ2Decompressor):
                if self.dec.eof:
                    return b""
                raw = self._raw() if self.dec.needs_input else b""
                if not raw and self.dec.needs_input:
                    return b""  # truncated: finish() tells
                out = self.dec.decompress(raw, want)
            else:
                if self.dec.eof:
                    return b""
                raw = self.dec.unconsumed_tail or self._raw()
                if not raw:
                    return b""
                out = self.dec.decompress(raw, want)
        return out

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes; more than the declared size is an error, never a big buffer."""
        parts = []
        have = 0
        while have < n:
            # One byte past what is allowed shows a member inflating beyond its declared size.
            try:
                piece = self._inflate(min(CHUNK, n - have, self.left + 1))
            except (zlib.error, OSError, EOFError, ValueError) as exc:
                raise AgentError(self.code, "{}: member {!r} does not inflate ({})".format(
                    self.source, self.info.filename, exc))
            if not piece:
                break
            if len(piece) > self.left:
                raise AgentError(self.code, "{}: member {!r} inflates to more than the {:,} "
                                 "bytes it declares".format(self.source, self.info.filename,
                                                            self.info.file_size))
            self.left -= len(piece)
            self.crc = zlib.crc32(piece, self.crc)
            parts.append(piece)
            have += len(piece)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def finish(self) -> None:
        """The member holds nothing after the data, and its CRC matches."""
        if self.read(1):
            raise AgentError(self.code, "{}: member {!r} holds data after its array".format(
                self.source, self.info.filename))
        if self.left != 0 or (self.crc & 0xffffffff) != self.info.CRC:
            raise AgentError(self.code, "{}: member {!r} is damaged (size or CRC-32 does not "
                             "match the archive's directory)".format(self.source,
                                                                   self.info.filename))


def list_members(f: BinaryIO, code: str, source: str, size: int, max_members: int
                 ) -> List[zipfile.ZipInfo]:
    """The archive's directory, refused when it declares more than ``max_members`` entries
    (checked from the end record before ``zipfile`` reads them all, where it can)."""
    end = getattr(zipfile, "_EndRecData", None)
    if end is not None:
        record = end(f)
        if record is None:
            raise AgentError(code, "{}: expected a .npz (zip) archive, found no zip "
                             "directory".format(source))
        entries = record[getattr(zipfile, "_ECD_ENTRIES_TOTAL", 4)]
        if entries > max_members:
            raise AgentError(code, "{}: expected at most {} arrays, found an archive "
                             "declaring {:,}".format(source, max_members, entries))
    f.seek(0)
    try:
        infos = zipfile.ZipFile(f).infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError,
            NotImplementedError, struct.error) as exc:
        raise AgentError(code, "{}: expected a .npz (zip) archive, found one that does not "
                         "read ({})".format(source, exc))
    if len(infos) > max_members:
        raise AgentError(code, "{}: expected at most {} arrays, found {:,}".format(
            source, max_members, len(infos)))
    return infos
