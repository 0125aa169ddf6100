"""The app's donated inputs (``agent.client.donate``): a bounded ring of real inputs per model
name, kept on the device only (docs/using-models.md, "Live inputs").

    <state_dir>/samples/<name>/<seq>-<rows>.npz   one donation: input name -> array [rows, ...]
    <state_dir>/samples/<name>/field.json   the last INT8 range figures
                                            (agent.device.models.live_check)

A donation is checked against the inputs of the name's current version (meta.json: the same
input names, their dtypes, their fixed dimensions; one sample or a batch of rows), read as
hostile input (``agent.engines.safe_npz``) and written atomically, 0600 under the private
state directory. The ring keeps at most ``keep`` rows and ``keep_bytes`` bytes per name: the
oldest donations go first. Nothing here leaves the device; ``jetson-agent models samples
export`` is the operator's way out. One donation is taken at a time: the app socket drops
another that comes meanwhile rather than make the app wait.
"""

import io
import json
import os
import re
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from agent.device.app.server import MAX_PAYLOAD
from agent.errors import AgentError
from agent.fsio import atomic_write
from agent.wire.model_names import validate_name

if TYPE_CHECKING:
    import numpy as np

# numpy and the npz reader are imported when a donation comes: an idle daemon loads neither.

CODE = "bad_donation"
MAX_DONATION_BYTES = MAX_PAYLOAD  # one request's payload (the socket refuses more unread)
MAX_INPUTS = 64
FIELD = "field.json"
_FILE = re.compile(r"^(\d{12})-(\d{1,9})\.npz$")


def _is_fixed(dim: Any) -> bool:
    return isinstance(dim, int) and not isinstance(dim, bool) and dim > 0


def check_inputs(arrays: Dict[str, "np.ndarray"], specs: List[Dict[str, Any]],
                 where: str) -> Dict[str, "np.ndarray"]:
    """``arrays`` against the model's inputs (meta.json's ``inputs``): the same names, dtypes,
    fixed dimensions; a single sample gains the batch axis. Returns the arrays as rows
    (equal counts); AgentError bad_donation saying what was expected and found."""
    import numpy as np

    want = {s["name"]: s for s in specs}
    if set(arrays) != set(want):
        raise AgentError(CODE, "{}: expected inputs {}, found {}".format(
            where, ", ".join(sorted(want)) or "none", ", ".join(sorted(arrays))[:300] or "none"))
    out: Dict[str, "np.ndarray"] = {}
    for name, arr in arrays.items():
        spec = want[name]
        shape = list(spec.get("shape") or [])
        if str(arr.dtype) != str(spec.get("dtype")):
            raise AgentError(CODE, "{}: input {!r}: expected dtype {}, found {}".format(
                where, name, spec.get("dtype"), arr.dtype))
        if arr.ndim == len(shape) - 1 and shape:
            arr = arr[None]  # one sample
        if arr.ndim != len(shape) or any(
                _is_fixed(d) and d != n for d, n in zip(shape[1:], arr.shape[1:])):
            raise AgentError(CODE, "{}: input {!r}: expected shape {} (or one sample of it), "
                             "found {}".format(where, name, shape, list(arr.shape)))
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise AgentError(CODE, "{}: input {!r}: expected finite values, found NaN or "
                             "infinity".format(where, name))
        out[name] = arr
    rows = {a.shape[0] for a in out.values()}
    if len(rows) != 1 or 0 in rows:
        raise AgentError(CODE, "{}: expected the same number (>= 1) of rows in every input, "
                         "found {}".format(where, {k: a.shape[0] for k, a in out.items()}))
    return out


def current_inputs(models_dir: str, name: str) -> List[Dict[str, Any]]:
    """The inputs of ``name``'s current version (meta.json); bad_donation without one."""
    path = os.path.join(models_dir, name, "current", "meta.json")
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read(1 << 20).decode("utf-8"))
        inputs = meta["inputs"]
        if not isinstance(inputs, list) or not inputs:
            raise ValueError("no inputs")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AgentError(CODE, "expected {} to have a current version whose meta.json names "
                         "its inputs, found none ({})".format(name, exc))
    return inputs


class SampleStore(object):
    """The rings of one device (``root``: ``<state_dir>/samples``)."""

    def __init__(self, root: str, keep: int = 256, keep_bytes: int = 64 << 20) -> None:
        self.root, self.keep, self.keep_bytes = root, int(keep), int(keep_bytes)
        self.lock = threading.Lock()

    @classmethod
    def for_config(cls, cfg: Any) -> "SampleStore":
        from agent.fsio import state_dir as default_state_dir

        live = cfg.models.live_check
        root = os.path.join(cfg.state_dir or default_state_dir(), "samples")
        return cls(root, live.keep, live.keep_bytes)

    def dir(self, name: str) -> str:
        return os.path.join(self.root, name)

    def files(self, name: str) -> List[Tuple[int, str, int, int]]:
        """(seq, path, rows, bytes) of each donation kept, oldest first."""
        out = []
        try:
            entries = os.listdir(self.dir(name))
        except OSError:
            return []
        for entry in entries:
            m = _FILE.match(entry)
            if not m:
                continue
            path = os.path.join(self.dir(name), entry)
            try:  # the rows are in the name: counted without reading (a damaged file is
                # left out when read)
                out.append((int(m.group(1)), path, int(m.group(2)), os.path.getsize(path)))
            except OSError:
                continue  # gone meanwhile
        return sorted(out)

    def count(self, name: str) -> int:
        return sum(f[2] for f in self.files(name))

    # -- in ------------------------------------------------------------------------------------
    def donate(self, models_dir: str, name: str, payload: bytes) -> Dict[str, Any]:
        """One donation (npz bytes) for ``name``: checked and kept (the app socket hands over
        one at a time)."""
        validate_name(name)
        with self.lock:
            rows = self._add(models_dir, name, payload)
            return {"name": name, "kept": rows, "samples": self.count(name)}

    def _add(self, models_dir: str, name: str, payload: bytes) -> int:
        limit = min(self.keep_bytes, MAX_DONATION_BYTES)
        if len(payload) > limit:
            raise AgentError(CODE, "expected a donation of at most {:,} bytes "
                             "(models.live_check.keep_bytes), found {:,}".format(
                                 limit, len(payload)))
        import numpy as np

        from agent.engines import safe_npz

        where = "donation for {}".format(name)
        specs = current_inputs(models_dir, name)
        headers = safe_npz.NpzHeaders(where, CODE, where, fileobj=io.BytesIO(payload),
                                      budget_size=len(payload))
        if len(headers.headers) > MAX_INPUTS or headers.total_bytes > limit:
            raise AgentError(CODE, "{}: expected at most {} inputs and {:,} bytes, found {} "
                             "and {:,}".format(where, MAX_INPUTS, limit, len(headers.headers),
                                               headers.total_bytes))
        arrays = check_inputs(dict(headers.arrays()), specs, where)
        rows = next(iter(arrays.values())).shape[0]
        if rows > self.keep:
            raise AgentError(CODE, "{}: expected at most {} rows (models.live_check.keep), "
                             "found {}".format(where, self.keep, rows))
        buf = io.BytesIO()
        np.savez(buf, **arrays)  # type: ignore[arg-type]
        kept = self.files(name)
        seq = kept[-1][0] + 1 if kept else 1
        folder = self.dir(name)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        atomic_write(os.path.join(folder, "{:012d}-{}.npz".format(seq, rows)), buf.getvalue())
        self._trim(name)
        return rows

    def _trim(self, name: str) -> None:
        kept = self.files(name)
        rows, size = sum(f[2] for f in kept), sum(f[3] for f in kept)
        while len(kept) > 1 and (rows > self.keep or size > self.keep_bytes):
            _seq, path, r, b = kept.pop(0)
            try:
                os.unlink(path)
            except OSError:
                pass
            rows, size = rows - r, size - b

    # -- out -----------------------------------------------------------------------------------
    def newest(self, name: str) -> List[str]:
        """The donation files, newest first (what ``agent.precision.live.load_rows`` reads)."""
        return [f[1] for f in reversed(self.files(name))]

    def load(self, name: str) -> Dict[str, Any]:
        """The newest ``keep`` rows, input -> array; {} with none."""
        from agent.precision.live import load_rows

        return load_rows(self.newest(name), self.keep)

    def write_field(self, name: str, figures: Dict[str, Any]) -> None:
        os.makedirs(self.dir(name), mode=0o700, exist_ok=True)
        atomic_write(os.path.join(self.dir(name), FIELD),
                     json.dumps(figures, sort_keys=True).encode("utf-8"))

    def read_field(self, name: str) -> Optional[Dict[str, Any]]:
        try:
            with open(os.path.join(self.dir(name), FIELD), "rb") as f:
                out = json.loads(f.read(1 << 20).decode("utf-8"))
            return out if isinstance(out, dict) else None
        except (OSError, ValueError):
            return None
