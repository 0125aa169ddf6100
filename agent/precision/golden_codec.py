"""Polygraphy's golden-file encodings, read bounded (worker side: Python 3.6).

- JSON: arrays are ``{"array": base64 of np.save bytes, "polygraphy_class": "ndarray"}``,
  lazy arrays ``{"values": ..., "polygraphy_class": "LazyArray"}``; older files mark types with
  ``__polygraphy_encoded_*`` keys and may hold latin-1 array text or a whole .npz. Decoding runs
  as the JSON parser's object hook, so the bytes every array inflates to are capped per file
  while the file is read.
- ``.npz``: one iteration keyed by tensor name, or several keyed ``iteration_<i>/<name>``.

Arrays are read with ``agent.engines.safe_npz`` (headers and declared sizes first, no pickles).
``golden`` builds the inputs/outputs documents on these; files that cannot be parsed raise
``bad_golden_file``.
"""

import base64
import binascii
import io
import json
import os
import re
import sys
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from agent.engines import safe_npz
from agent.errors import AgentError
from agent.fsio import atomic_write

Feed = Dict[str, np.ndarray]
TYPE_MARKER = "polygraphy_class"
LEGACY_PREFIX = "__polygraphy_encoded_"
NPZ_ITERATION = re.compile(r"^iteration_(\d+)/(.+)$")


def encode_array(array: np.ndarray) -> Dict[str, Any]:
    buf = io.BytesIO()
    np.save(buf, np.asarray(array), allow_pickle=False)
    return OrderedDict([("array", base64.b64encode(buf.getvalue()).decode("ascii")),
                        (TYPE_MARKER, "ndarray")])


def decode_array(dct: Dict[str, Any], source: str = "file",
                 budget_size: Optional[int] = None) -> np.ndarray:
    """The array of a Polygraphy-encoded dict; ``budget_size`` is the size of the file it came
    from (what an embedded .npz may inflate to is a multiple of it)."""
    data = dct.get("array")
    if not isinstance(data, str):
        raise AgentError("bad_golden_file", "{}: expected an encoded array ({{\"array\": "
                         "base64}}), found keys {}".format(source, sorted(dct)))
    try:
        raw = base64.b64decode(data.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raw = data.encode("latin-1", errors="replace")  # very old Polygraphy files
    if not raw.startswith(b"PK"):
        return safe_npz.read_npy_bytes(raw, "bad_golden_file", source, budget_size)
    values = list(safe_npz.read_npz_bytes(raw, "bad_golden_file", source,  # old Polygraphy
                                          budget_size).values())
    if not values:
        raise AgentError("bad_golden_file", "{}: an encoded array holds nothing".format(source))
    return np.asarray(values[0])


def type_of(dct: Dict[str, Any]) -> Optional[str]:
    marker = dct.get(TYPE_MARKER)
    if isinstance(marker, str):
        return marker
    for key in dct:
        if key.startswith(LEGACY_PREFIX):
            return key[len(LEGACY_PREFIX):]
    return None


def _decoder(source: str) -> Any:
    size = os.path.getsize(source) if os.path.isfile(source) else None
    used = [0]  # bytes decoded so far: capped per file like an .npz

    def hook(pairs: List[Tuple[str, Any]]) -> Any:
        dct = OrderedDict(pairs)
        kind = type_of(dct)
        if kind == "ndarray":
            arr = decode_array(dct, source, size)
            used[0] += arr.nbytes
            limit = safe_npz.limit_for(size or arr.nbytes)
            if used[0] > limit:
                raise AgentError("bad_golden_file", "{}: arrays decode to more than {:,} bytes "
                                 "(limits.inflate_ratio x the file's {:,} bytes, at most "
                                 "limits.max_data_bytes)".format(source, limit, size or 0))
            return arr
        if kind in ("LazyArray", "LazyNumpyArray"):
            return dct.get("values")
        return dct
    return hook


def read_json(path: str, what: str = "golden file") -> Any:
    must_exist(path, what)
    try:
        with open(path, "r") as f:
            return json.load(f, object_pairs_hook=_decoder(path))
    except ValueError as exc:
        raise AgentError("bad_golden_file", "{}: expected Polygraphy JSON, found text that does "
                         "not parse ({})".format(path, exc))
    except UnicodeDecodeError:
        raise AgentError("bad_golden_file", "{}: expected Polygraphy JSON, found binary "
                         "data".format(path))
    except RecursionError:
        raise AgentError("bad_golden_file", "{}: expected Polygraphy JSON, found lists or "
                         "objects nested deeper than the parser allows (~{} levels)".format(
                             path, sys.getrecursionlimit()))


def must_exist(path: str, what: str = "golden file") -> None:
    """``what`` names the file as the user named it (--load-inputs is an inputs file)."""
    if not os.path.isfile(path):
        raise AgentError("file_not_found", "{} {} {}".format(
            what, path, "is a directory, expected a file" if os.path.isdir(path)
            else "does not exist"))


def as_feed(obj: Any, what: str) -> Feed:
    if not isinstance(obj, dict) or not all(isinstance(v, np.ndarray) for v in obj.values()):
        raise AgentError("bad_golden_file", "{}: expected a dict of tensor name -> array, "
                         "found {}".format(what, type(obj).__name__))
    return OrderedDict((str(k), v) for k, v in obj.items())


def is_npz(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def load_npz(path: str) -> List[Feed]:
    items = list(safe_npz.read_npz(path, "bad_golden_file").items())
    iterations: Dict[int, Feed] = {}
    plain: Feed = OrderedDict()
    for key, arr in items:
        m = NPZ_ITERATION.match(key)
        if m:
            iterations.setdefault(int(m.group(1)), OrderedDict())[m.group(2)] = arr
        else:
            plain[key] = arr
    if iterations and plain:
        raise AgentError("bad_golden_file", "{}: expected either plain tensor names or "
                         "iteration_<i>/<name> keys, found both".format(path))
    if not iterations:
        return [plain]
    indices = sorted(iterations)
    if indices != list(range(len(indices))):
        raise AgentError("bad_golden_file", "{}: expected iterations 0..{}, found {}".format(
            path, len(indices) - 1, indices))
    return [iterations[i] for i in indices]


def save_npz(path: str, feeds: Sequence[Feed]) -> None:
    arrays: Dict[str, np.ndarray] = OrderedDict()
    if len(feeds) == 1:
        arrays.update(feeds[0])
    else:
        for i, feed in enumerate(feeds):
            for name, arr in feed.items():
                arrays["iteration_{}/{}".format(i, name)] = arr
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    atomic_write(path, buf.getvalue())
