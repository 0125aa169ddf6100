"""Streaming calibration datasets: .npy / .npz shards and Polygraphy ``--save-inputs`` JSON.

Accepted layouts (every array has a leading sample axis, like the model's batch axis):

- a directory of ``.npz`` shards, each holding one array per model input (key = input name);
- a directory of ``.npy`` shards: ``<input>.npy``, or several per input named with the input
  name as prefix (``<input>_0001.npy``, ``<input>.1.npy``, ``<input>-2.npy``), paired across
  inputs in sorted order; for a one-input model any ``.npy`` names are accepted;
- a single ``.npz`` file, or a single ``.npy`` file for a one-input model;
- a Polygraphy ``--save-inputs`` JSON file: a list of ``{input: {"array": base64 of np.save
  bytes, "polygraphy_class": "ndarray"}}`` feeds, each one shard.

Streaming: shard headers are read when the dataset is opened (names, dtypes and shapes are
checked then, so bad data fails before any build work), and while iterating only one shard is
loaded at a time (``.npy`` shards are memory-mapped). A Polygraphy JSON file is parsed whole
and kept as its base64 text; its arrays are decoded one feed at a time.

Batches are re-cut to ``batch_size`` along axis 0. The last, smaller batch is kept when every
input's batch dimension is dynamic and dropped otherwise. ``shuffle_seed`` shuffles the shard
order and the samples within each shard (the same order on every pass).

Dtypes: data of the same kind as the model input (float64 or float16 for float32) or a safe
widening (int or bool for float) is accepted and cast batch by batch; anything else (float for
an int input, complex, objects) is refused.

Hostile files: ``calib.shards`` reads them with ``agent.engines.safe_npz`` (no pickles or
object arrays; a header must declare what the file holds; what an .npz inflates to is capped per
file before anything is inflated, and members are inflated in bounded chunks), refused as
``bad_calibration_data``.

Worker side: Python >= 3.6.
"""

import hashlib
import os
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from agent.engines.backends.base import TensorSpec
from agent.errors import AgentError
from calib.shards import JsonFeedShard, NpyGroupShard, NpzShard, Shard, read_json_feeds

NPY_SEPARATORS = "_.-"


def _is_dynamic(dim: Any) -> bool:
    return not (isinstance(dim, (int, np.integer)) and not isinstance(dim, bool) and dim > 0)


def _dims_text(shape: Sequence[Any]) -> str:
    return "[" + ", ".join("?" if _is_dynamic(d) else str(int(d)) for d in shape) + "]"


class CalibrationDataset(object):
    """Calibration batches for a model with inputs ``input_specs``; iterate for
    ``Dict[input name, ndarray]`` batches (as many passes as wanted)."""

    def __init__(
        self,
        path: str,
        input_specs: List[TensorSpec],
        batch_size: int,
        shuffle_seed: Optional[int] = None,
        max_samples: Optional[int] = None,
    ) -> None:
        if not input_specs:
            raise AgentError("bad_argument", "the model has no inputs to calibrate")
        if int(batch_size) < 1:
            raise AgentError("bad_argument",
                             "calibration batch size must be >= 1, found {}".format(batch_size))
        if max_samples is not None and int(max_samples) < 1:
            raise AgentError("bad_argument",
                             "max_samples must be >= 1, found {}".format(max_samples))
        self.path = path
        self.specs = {spec.name: spec for spec in input_specs}
        self.batch_size = int(batch_size)
        self.shuffle_seed = shuffle_seed
        self.max_samples = None if max_samples is None else int(max_samples)
        for spec in input_specs:
            dim0 = spec.shape[0] if spec.shape else None
            if dim0 is not None and not _is_dynamic(dim0) and int(dim0) != self.batch_size:
                raise AgentError(
                    "bad_argument",
                    "calibration batch size {} does not fit input {!r}, whose batch dimension "
                    "is fixed to {}".format(self.batch_size, spec.name, dim0))
        # A partial last batch only fits when every batch dimension is dynamic.
        self.drop_last = any(spec.shape and not _is_dynamic(spec.shape[0])
                             for spec in input_specs)
        self._json_path: Optional[str] = None
        self._shards = self._discover(path)
        for shard in self._shards:
            self._validate(shard)
        self._total = sum(shard.count for shard in self._shards)
        if self._total == 0:
            raise AgentError("empty_calibration_data",
                             "{}: expected at least one calibration sample, found 0 in {} "
                             "shard(s)".format(path, len(self._shards)))
        if self.drop_last and self.num_batches() == 0:
            raise AgentError("empty_calibration_data",
                             "{}: expected at least one full batch of {} samples, found {} "
                             "sample(s)".format(path, self.batch_size, self.num_samples()))
        self._digest: Optional[str] = None

    # -- discovery -------------------------------------------------------------------------

    def _discover(self, path: str) -> List[Shard]:
        if not os.path.exists(path):
            raise AgentError("file_not_found",
                             "calibration data {} does not exist".format(path))
        if os.path.isdir(path):
            return self._discover_dir(path)
        lower = path.lower()
        if lower.endswith(".npz"):
            return [NpzShard(path)]
        if lower.endswith(".npy"):
            return [self._npy_single(path)]
        if lower.endswith(".json"):
            self._json_path = path
            feeds = read_json_feeds(path)
            return [JsonFeedShard(path, i, feed) for i, feed in enumerate(feeds)]
        raise AgentError("bad_calibration_data",
                         "{}: expected a directory of .npy/.npz shards, a .npz, a .npy or a "
                         "Polygraphy inputs .json file, found another kind of file".format(path))

    def _npy_single(self, path: str) -> Shard:
        if len(self.specs) != 1:
            raise AgentError("bad_calibration_data",
                             "{}: a single .npy file holds one input but the model has {} "
                             "({}); use a .npz or a directory of shards".format(
                                 path, len(self.specs), ", ".join(sorted(self.specs))))
        return NpyGroupShard({next(iter(self.specs)): path})

    def _discover_dir(self, path: str) -> List[Shard]:
        names = sorted(n for n in os.listdir(path) if not n.startswith("."))
        npz = [os.path.join(path, n) for n in names if n.lower().endswith(".npz")]
        npy = [n for n in names if n.lower().endswith(".npy")]
        if npz and npy:
            raise AgentError("bad_calibration_data",
                             "{}: expected either .npz or .npy shards, found both ({} and "
                             "{})".format(path, os.path.basename(npz[0]), npy[0]))
        if npz:
            return [NpzShard(p) for p in npz]
        if not npy:
            raise AgentError("empty_calibration_data",
                             "{}: expected .npy or .npz shards, found none".format(path))
        groups: Dict[str, List[str]] = {name: [] for name in self.specs}
        for filename in npy:
            owner = self._npy_owner(filename[:-4])
            if owner is None:
                raise AgentError(
                    "bad_calibration_data",
                    "{}: expected .npy shards named after a model input ({}), optionally "
                    "followed by _N / .N / -N, found a file matching none".format(
                        os.path.join(path, filename), ", ".join(sorted(self.specs))))
            groups[owner].append(os.path.join(path, filename))
        counts = {name: len(files) for name, files in groups.items()}
        if len(set(counts.values())) != 1:
            raise AgentError(
                "bad_calibration_data",
                "{}: expected the same number of .npy shards for every input, found {}".format(
                    path, ", ".join("{}: {}".format(n, c) for n, c in sorted(counts.items()))))
        return [NpyGroupShard({name: files[k] for name, files in groups.items()})
                for k in range(len(next(iter(groups.values()))))]

    def _npy_owner(self, stem: str) -> Optional[str]:
        """The input a .npy shard belongs to (the longest matching name wins)."""
        if stem in self.specs:
            return stem
        matches = [name for name in self.specs
                   if stem.startswith(name) and len(stem) > len(name)
                   and stem[len(name)] in NPY_SEPARATORS]
        if matches:
            return max(matches, key=len)
        if len(self.specs) == 1:
            return next(iter(self.specs))
        return None

    # -- validation ------------------------------------------------------------------------

    def _validate(self, shard: Shard) -> None:
        found = set(shard.header)
        unknown = sorted(found - set(self.specs))
        if unknown:
            raise AgentError("bad_calibration_data",
                             "{}: found array {!r}, which is not a model input (expected "
                             "{})".format(shard.label, unknown[0], ", ".join(sorted(self.specs))),
                             {"file": shard.label, "input": unknown[0]})
        missing = sorted(set(self.specs) - found)
        if missing:
            raise AgentError("bad_calibration_data",
                             "{}: expected an array for model input {!r}, found only {}".format(
                                 shard.label, missing[0], ", ".join(sorted(found)) or "none"),
                             {"file": shard.label, "input": missing[0]})
        counts = set()
        for name, (shape, dtype) in sorted(shard.header.items()):
            spec = self.specs[name]
            details = {"file": shard.label, "input": name}
            if not self._castable(dtype, spec.dtype):
                raise AgentError("bad_calibration_data",
                                 "{}: input {!r}: expected dtype {} (or one that casts to it "
                                 "safely), found {}".format(shard.label, name, spec.dtype, dtype),
                                 details)
            if len(shape) != len(spec.shape) or not shape:
                raise AgentError("bad_calibration_data",
                                 "{}: input {!r}: expected shape {} (rank {}, samples on axis "
                                 "0), found {}".format(shard.label, name, _dims_text(spec.shape),
                                                       len(spec.shape), list(shape)),
                                 details)
            for axis in range(1, len(shape)):
                want = spec.shape[axis]
                if not _is_dynamic(want) and int(want) != shape[axis]:
                    raise AgentError("bad_calibration_data",
                                     "{}: input {!r}: expected shape {}, found {} (axis {})".format(
                                         shard.label, name, _dims_text(spec.shape), list(shape),
                                         axis),
                                     details)
            counts.add(shape[0])
        if len(counts) > 1:
            raise AgentError("bad_calibration_data",
                             "{}: expected the same number of samples for every input, found "
                             "{}".format(shard.label, ", ".join(
                                 "{}: {}".format(n, s[0][0])
                                 for n, s in sorted(shard.header.items()))),
                             {"file": shard.label})
        shard.count = counts.pop() if counts else 0

    @staticmethod
    def _castable(found: np.dtype, expected: np.dtype) -> bool:
        if found.kind in "OVSUcMm" or found.hasobject:
            return False
        return bool(np.can_cast(found, expected, casting="same_kind"))

    # -- sizes and identity ----------------------------------------------------------------

    def num_samples(self) -> int:
        if self.max_samples is None:
            return self._total
        return min(self._total, self.max_samples)

    def num_batches(self) -> int:
        full, rest = divmod(self.num_samples(), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __len__(self) -> int:
        return self.num_batches()

    def files(self) -> List[str]:
        seen: List[str] = []
        for shard in self._shards:
            for f in shard.files:
                if f not in seen:
                    seen.append(f)
        return seen

    def digest(self) -> str:
        """sha256 over the data files (relative name, size, bytes), in a fixed order."""
        if self._digest is None:
            h = hashlib.sha256()
            base = self.path if os.path.isdir(self.path) else os.path.dirname(self.path)
            for f in sorted(self.files()):
                h.update(os.path.relpath(f, base).encode("utf-8") + b"\0")
                h.update(str(os.path.getsize(f)).encode("ascii") + b"\0")
                with open(f, "rb") as stream:
                    for block in iter(lambda: stream.read(1 << 20), b""):
                        h.update(block)
            self._digest = h.hexdigest()
        return self._digest

    # -- iteration -------------------------------------------------------------------------

    def _shard_order(self) -> Tuple[List[Shard], Optional[np.random.RandomState]]:
        if self.shuffle_seed is None:
            return list(self._shards), None
        rng = np.random.RandomState(self.shuffle_seed)
        order = rng.permutation(len(self._shards))
        return [self._shards[i] for i in order], rng

    def _load(self, shard: Shard) -> Dict[str, np.ndarray]:
        try:
            arrays = shard.load()
        except (OSError, ValueError) as exc:
            raise AgentError("bad_calibration_data",
                             "{}: expected readable NumPy data, found a damaged file "
                             "({})".format(shard.label, exc), {"file": shard.label})
        for name, array in arrays.items():
            if tuple(array.shape) != shard.header[name][0]:
                raise AgentError("bad_calibration_data",
                                 "{}: input {!r}: header said shape {}, data has {}".format(
                                     shard.label, name, list(shard.header[name][0]),
                                     list(array.shape)), {"file": shard.label, "input": name})
        return arrays

    def __iter__(self) -> Iterator[Dict[str, np.ndarray]]:
        shards, rng = self._shard_order()
        budget = self.num_samples()
        pending: List[Dict[str, np.ndarray]] = []  # pieces waiting to fill a batch
        pending_n = 0
        for shard in shards:
            if budget <= 0:
                break
            arrays = self._load(shard)
            take = min(shard.count, budget)
            budget -= take
            if rng is not None:
                index = rng.permutation(shard.count)[:take]
                arrays = {name: a[index] for name, a in arrays.items()}
            elif take < shard.count:
                arrays = {name: a[:take] for name, a in arrays.items()}
            start = 0
            while start < take:
                need = self.batch_size - pending_n
                piece = {name: a[start:start + need] for name, a in arrays.items()}
                n = min(need, take - start)
                pending.append(piece)
                pending_n += n
                start += n
                if pending_n == self.batch_size:
                    yield self._assemble(pending)
                    pending, pending_n = [], 0
            del arrays
        if pending_n and not self.drop_last:
            yield self._assemble(pending)

    def _assemble(self, pieces: List[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
        out: Dict[str, np.ndarray] = {}
        for name, spec in self.specs.items():
            parts = [p[name] for p in pieces]
            joined = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
            out[name] = np.ascontiguousarray(joined, dtype=spec.dtype)
        return out
