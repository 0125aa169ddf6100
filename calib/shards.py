"""Shards of a calibration dataset: the units ``CalibrationDataset`` loads one at a time (an
.npz file, a group of .npy files with one per input, or one feed of a Polygraphy
``--save-inputs`` JSON file). Each reads its headers when made (names, dtypes, shapes: checked
before any build work) and its arrays only on ``load``. Apart from the dataset because how each
file format is read, as hostile input through ``agent.engines.safe_npz``, is one job; how
shards are found, validated against the model and cut into batches is another.

Worker side: Python >= 3.6.
"""

import base64
import io
import json
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from agent.engines import safe_npz
from agent.errors import AgentError

CODE = "bad_calibration_data"
B64_HEADER_CHARS = 13360  # base64 of the longest .npy header safe_npz accepts (a multiple of 4)

# name -> (shape, dtype) as read from a header
Header = Dict[str, Tuple[Tuple[int, ...], np.dtype]]


class Shard(object):
    """One unit loaded at a time: a .npz file, a group of .npy files (one per input), or one
    Polygraphy feed."""

    def __init__(self, label: str, files: List[str], header: Header) -> None:
        self.label = label  # names the file(s) in error messages
        self.files = files  # the files its bytes come from (for digest)
        self.header = header
        self.count = 0

    def load(self) -> Dict[str, np.ndarray]:
        raise NotImplementedError


class NpzShard(Shard):
    def __init__(self, path: str) -> None:
        self.npz = safe_npz.NpzHeaders(path, CODE, skip_other=True)
        header: Header = {name: (h.shape, h.dtype) for name, (_i, h) in self.npz.headers.items()}
        super(NpzShard, self).__init__(path, [path], header)

    def load(self) -> Dict[str, np.ndarray]:
        return dict(self.npz.arrays(list(self.header)))


class NpyGroupShard(Shard):
    def __init__(self, paths: Dict[str, str]) -> None:
        header: Header = {}
        for name, path in paths.items():
            try:
                found = safe_npz.npy_file_header(path, CODE, "{} (input {!r})".format(path, name))
            except OSError as exc:
                raise AgentError(CODE, "{}: expected a NumPy .npy array for input {!r}, found "
                                 "unreadable data ({})".format(path, name, exc))
            header[name] = (found.shape, found.dtype)
        label = ", ".join(paths[n] for n in sorted(paths))
        super(NpyGroupShard, self).__init__(label, sorted(paths.values()), header)
        self.paths = paths

    def load(self) -> Dict[str, np.ndarray]:
        return {name: safe_npz.read_npy(path, CODE, mmap=True)
                for name, path in self.paths.items()}


def polygraphy_array(obj: Any) -> Optional[str]:
    """The base64 text of a Polygraphy-encoded array ({"array": ...} or a LazyArray)."""
    for _ in range(8):  # a loop, not recursion: the JSON may nest "values" deeply
        if not isinstance(obj, dict):
            return None
        if isinstance(obj.get("array"), str):
            return str(obj["array"])
        obj = obj.get("values")
    return None


class JsonFeedShard(Shard):
    def __init__(self, path: str, index: int, feed: Dict[str, Any]) -> None:
        label = "{} (feed {})".format(path, index)
        header: Header = {}
        self.encoded: Dict[str, str] = {}
        for name, value in feed.items():
            text = polygraphy_array(value)
            if text is None:
                raise AgentError("bad_calibration_data",
                                 "{}: input {!r}: expected a Polygraphy array "
                                 "({{\"array\": base64, \"polygraphy_class\": \"ndarray\"}}), "
                                 "found {}".format(label, name, type(value).__name__))
            what = "{} input {!r}".format(label, name)
            try:
                # The .npy header sits in the first bytes: decode a prefix only.
                prefix = base64.b64decode(text[:B64_HEADER_CHARS])
            except (ValueError, TypeError) as exc:
                raise AgentError(CODE, "{}: expected base64 np.save bytes, found undecodable "
                                 "data ({})".format(what, exc))
            found = safe_npz.read_header(io.BytesIO(prefix).read, CODE, what)
            holds = len(text) * 3 // 4 - found.header_len
            if found.nbytes > holds:
                raise AgentError(CODE, "{}: header declares shape {} of {} = {:,} bytes; the "
                                 "text holds at most {:,}".format(
                                     what, list(found.shape), found.dtype, found.nbytes, holds),
                                 {"declared_bytes": found.nbytes, "file_bytes": holds})
            header[name] = (found.shape, found.dtype)
            self.encoded[name] = text
        super(JsonFeedShard, self).__init__(label, [path], header)

    def load(self) -> Dict[str, np.ndarray]:
        return {name: safe_npz.read_npy_bytes(base64.b64decode(text), CODE,
                                              "{} input {!r}".format(self.label, name))
                for name, text in self.encoded.items()}


def read_json_feeds(path: str) -> List[Dict[str, Any]]:
    try:
        with open(path, "r") as f:
            feeds = json.load(f)
    except (OSError, ValueError) as exc:
        raise AgentError("bad_calibration_data",
                         "{}: expected Polygraphy --save-inputs JSON, found unparsable text "
                         "({})".format(path, exc))
    except RecursionError:
        raise AgentError("bad_calibration_data",
                         "{}: expected Polygraphy --save-inputs JSON, found lists or objects "
                         "nested deeper than the parser allows".format(path))
    if isinstance(feeds, dict) and "lst" in feeds:
        raise AgentError("bad_calibration_data",
                         "{}: expected Polygraphy --save-inputs JSON (a list of feeds), found "
                         "RunResults (--save-outputs)".format(path))
    if not isinstance(feeds, list) or not all(isinstance(f, dict) for f in feeds):
        raise AgentError("bad_calibration_data",
                         "{}: expected a list of {{input name: array}} feeds, found {}".format(
                             path, type(feeds).__name__))
    return feeds
