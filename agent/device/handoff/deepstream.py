"""DeepStream hand-off: the ``nvinfer`` config a DeepStream app reads, and the override file of
deepstream-test5's on-the-fly model update.

Owns two files named in the config: ``config`` (the nvinfer config: the user's ``template``, if
any, with the ``[property]`` keys below replaced, else a ``[property]`` group with only them) and,
optionally, ``override`` (the file passed to ``deepstream-test5-app -o``). Keys written:
``model-engine-file`` (the version folder's engine), ``network-mode`` (0 FP32, 1 INT8, 2 FP16,
from meta.json's precision; ``best`` is INT8), ``batch-size`` (at most the engine profile's
maximum batch: ``batch_size_exceeds_profile``), ``gpu-id``, ``int8-calib-file`` (INT8 only, when
the version folder holds ``calibration.cache`` or the config names one), ``enable-dla`` /
``use-dla-core`` (engines built for a DLA core), ``custom-lib-path`` (the TensorRT plugin library
the engine needs, from meta.json's ``plugins``; nvinfer loads one), and ``onnx-file`` only with
``onnx_file: true`` (it lets nvinfer rebuild an engine nobody gated when the engine does not
fit).

The override file is a deepstream-app config with a ``[primary-gie]`` group (``enable=1``,
``config-file``, ``model-engine-file``). test5 re-reads it on inotify events: a close-after-write
of that name, or a rename onto ``..data`` in its folder (the layout Kubernetes uses for mounted
config maps). A rename of the file itself triggers nothing, so the override is a symlink
``<file> -> ..data/<file>`` and ``..data`` a symlink to a hidden folder per update, swapped by
rename: atomic, and seen by test5. Keys and behaviour follow DeepStream 6.4 (Gst-nvinfer
configuration; deepstream-test5 on-the-fly model update; the same in 7.x).

One pipeline per model name: ``pipelines: {name: {config, template, override}}`` gives each name
its own nvinfer config (and override file); the top-level ``config``/``template``/``override``
are the pipeline of the one name the entry's ``models`` lists. A name with no pipeline is
refused (``no_pipeline``, naming the configured ones): two names never share an engine path.

``prepare`` checks the version and renders both files and, where the pipeline has an override
file (an on-the-fly update), that the new engine keeps the running one's input and output names,
shapes and types (test5 requires it; ``incompatible_engine`` names both signatures); ``switch``
writes them (the config first, then the override, which is the step test5 acts on), ``confirm``
has no opinion (the app reports health), ``revert`` writes the previous version's files (removes
them when there is none). An override file that started as a regular file (or the user's own
link) becomes the ``..data`` layout with its content unchanged first, so the first update is
one test5 sees.
"""

import json
import os
import shutil
import tempfile
import time
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

from agent.device.handoff.base import (
    Adapter,
    ModelVersion,
    check_batch_size,
    dla_core,
    plugin_libraries,
)
from agent.device.models.directory import CALIBRATION
from agent.errors import AgentError
from agent.fsio import atomic_write_text, fsync_dir
from agent.wire.model_names import validate_name

KEYS = ("config", "template", "override", "batch_size", "gpu_id", "onnx_file", "int8_calib_file",
        "pipelines")
PIPELINE_KEYS = ("config", "template", "override")
MAX_PIPELINES = 64
# best (int8 and fp16 allowed) is an int8 engine to nvinfer: its calibration file goes with it.
# "int8 (explicit)": an engine of a Q/DQ model (whatever its other layers run in): INT8.
NETWORK_MODE = {"fp32": 0, "int8": 1, "fp16": 2, "best": 1, "int8 (explicit)": 1}
MANAGED = ("model-engine-file", "network-mode", "batch-size", "gpu-id", "int8-calib-file",
           "enable-dla", "use-dla-core", "onnx-file", "custom-lib-path")
MAX_TEMPLATE = 1 << 20
DATA_LINK = "..data"


def _bad(where: str, key: str, expected: str, found: Any) -> AgentError:
    return AgentError("bad_config", "{}.{}: expected {}, found {!r}".format(
        where, key, expected, found))


def _path(section: Mapping[str, Any], where: str, key: str, required: bool = False
          ) -> Optional[str]:
    value = section.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip() or "\n" in value:
        raise _bad(where, key, "a file path", value)
    return os.path.abspath(value)


def _int(section: Mapping[str, Any], where: str, key: str, default: int, low: int, high: int
         ) -> int:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _bad(where, key, "an integer {}..{}".format(low, high), value)
    return value


def _template(section: Mapping[str, Any], where: str) -> Optional[str]:
    template = _path(section, where, "template")
    if template is None:
        return None
    try:
        with open(template, "rb") as f:
            data = f.read(MAX_TEMPLATE + 1)
    except OSError as exc:
        raise _bad(where, "template", "a readable nvinfer config", "{}: {}".format(
            template, exc.strerror))
    if len(data) > MAX_TEMPLATE or b"\0" in data:
        raise _bad(where, "template", "a text nvinfer config of at most 1 MiB", template)
    text = data.decode("utf-8", "replace")
    if "[property]" not in (line.strip() for line in text.splitlines()):
        raise _bad(where, "template", "an nvinfer config with a [property] group", template)
    return text


def _pipeline(section: Mapping[str, Any], where: str) -> "Pipeline":
    config = _path(section, where, "config", required=True) or ""
    override = _path(section, where, "override")
    if override is not None and override == config:
        raise _bad(where, "override", "a file other than config", section.get("override"))
    return Pipeline(config, override, _template(section, where))


class Pipeline(NamedTuple):
    """One DeepStream pipeline's files: its nvinfer config, its template, its override."""

    config: str
    override: Optional[str]
    template: Optional[str]


def from_config(section: Mapping[str, Any], where: str) -> "DeepStreamAdapter":
    unknown = sorted(set(section) - set(KEYS))
    if unknown:
        raise _bad(where, unknown[0], "one of " + ", ".join(KEYS), unknown[0])
    onnx_file = section.get("onnx_file", False)
    if not isinstance(onnx_file, bool):
        raise _bad(where, "onnx_file", "true or false", onnx_file)
    pipelines: Dict[str, Pipeline] = {}
    named = section.get("pipelines")
    if named is not None:
        if not isinstance(named, Mapping) or not named or len(named) > MAX_PIPELINES:
            raise _bad(where, "pipelines", "a mapping of model name to {{config, template, "
                       "override}} (at most {})".format(MAX_PIPELINES), named)
        for name, entry in named.items():
            at = "{}.pipelines[{!r}]".format(where, name)
            try:
                validate_name(name)
            except AgentError as exc:
                raise AgentError("bad_config", "{}: {}".format(at, exc.message))
            if not isinstance(entry, Mapping) or set(entry) - set(PIPELINE_KEYS):
                raise AgentError("bad_config", "{}: expected {{config, template, override}}, "
                                 "found {!r}".format(at, entry))
            pipelines[name] = _pipeline(entry, at)
        if any(k in section for k in PIPELINE_KEYS):
            raise _bad(where, "config", "either config (one name) or pipelines (per name), not "
                       "both", section.get("config"))
        files = [f for p in pipelines.values() for f in (p.config, p.override) if f]
        if len(set(files)) != len(files):
            raise _bad(where, "pipelines", "a config and an override file of its own per name",
                       sorted(f for f in files if files.count(f) > 1)[0])
        single = None
    else:
        single = _pipeline(section, where)
    return DeepStreamAdapter(
        single=single, pipelines=pipelines,
        batch_size=_int(section, where, "batch_size", 1, 1, 1024),
        gpu_id=_int(section, where, "gpu_id", 0, 0, 64), onnx_file=onnx_file,
        int8_calib_file=_path(section, where, "int8_calib_file"), where=where)


def signature(meta: Mapping[str, Any]) -> Dict[str, List[Tuple[str, str, str]]]:
    """{"inputs": [(name, dtype, shape)], "outputs": [...]} of a version's meta.json, for the
    on-the-fly update's compatibility check."""
    out: Dict[str, List[Tuple[str, str, str]]] = {}
    for section in ("inputs", "outputs"):
        found = meta.get(section)
        tensors: List[Any] = found if isinstance(found, list) else []
        out[section] = [(str(t.get("name")), str(t.get("dtype")), json.dumps(t.get("shape")))
                        for t in tensors[:256] if isinstance(t, dict)]
    return out


def describe(sig: Mapping[str, List[Tuple[str, str, str]]]) -> str:
    return "; ".join("{} {}".format(section, ", ".join(
        "{} {} {}".format(n, d, shape) for n, d, shape in sig[section]) or "none")
        for section in ("inputs", "outputs"))


def property_keys(version: ModelVersion, batch_size: int = 1, gpu_id: int = 0,
                  onnx_file: bool = False, int8_calib_file: Optional[str] = None
                  ) -> List[Tuple[str, str]]:
    """The ``[property]`` keys for ``version``, in the order they are written."""
    precision = str(version.meta.get("precision", "")).lower()
    if precision not in NETWORK_MODE:
        raise AgentError("handoff_failed", "meta.json of {}@{}: expected precision fp32, fp16 "
                         "int8 or best for nvinfer's network-mode, found {!r}".format(
                             version.name, version.version, version.meta.get("precision")))
    check_batch_size(version, batch_size, "batch-size")
    keys = [("model-engine-file", version.engine),
            ("network-mode", str(NETWORK_MODE[precision])),
            ("batch-size", str(batch_size)), ("gpu-id", str(gpu_id))]
    if NETWORK_MODE[precision] == 1 and precision != "int8 (explicit)":  # Q/DQ: in the engine
        in_folder = os.path.join(version.path, CALIBRATION)
        calib = in_folder if os.path.isfile(in_folder) else int8_calib_file
        if calib:
            keys.append(("int8-calib-file", calib))
    dla = dla_core(version.meta)
    if dla is not None:
        keys += [("enable-dla", "1"), ("use-dla-core", str(dla))]
    libraries = plugin_libraries(version.meta)
    if len(libraries) > 1:
        raise AgentError("handoff_failed", "{}@{} needs plugin libraries {}: expected at most "
                         "one, nvinfer loads a single custom-lib-path".format(
                             version.name, version.version, ", ".join(libraries)))
    if libraries:  # nvinfer loads it before deserializing the engine
        keys.append(("custom-lib-path", libraries[0]))
    if onnx_file:
        keys.append(("onnx-file", os.path.join(version.path, "model.onnx")))
    for key, value in keys:
        if "\n" in value or "\r" in value:
            raise AgentError("handoff_failed", "expected a one-line value for {}, found "
                             "{!r}".format(key, value))
    return keys


def render_nvinfer(keys: List[Tuple[str, str]], template: Optional[str] = None) -> str:
    """The nvinfer config: ``template`` with its managed ``[property]`` keys replaced by
    ``keys`` (the rest of the file kept as it is), or a ``[property]`` group of ``keys``."""
    ours = ["{}={}".format(k, v) for k, v in keys]
    if template is None:
        return "[property]\n" + "\n".join(ours) + "\n"
    out: List[str] = []
    group = None
    for line in template.splitlines():
        stripped = line.strip()
        if stripped.startswith("[") and stripped.endswith("]"):
            group = stripped[1:-1].strip()
            out.append(line)
            if group == "property":
                out.extend(ours)
            continue
        key = stripped.split("=", 1)[0].strip() if "=" in stripped else None
        if group == "property" and key in MANAGED:
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def render_override(config: str, engine: str) -> str:
    """The deepstream-test5 override file: a deepstream-app config whose ``[primary-gie]``
    group names the new engine (test5 applies it with ``model-engine-file``)."""
    return "[primary-gie]\nenable=1\nconfig-file={}\nmodel-engine-file={}\n".format(config, engine)


def _swap_data(folder: str, fresh: str) -> None:
    """Point ``..data`` at ``fresh`` by renaming a new link over it (test5's IN_MOVED_TO)."""
    tmp_link = os.path.join(folder, DATA_LINK + "_tmp")
    if os.path.lexists(tmp_link):
        os.unlink(tmp_link)
    os.symlink(os.path.basename(fresh), tmp_link)
    os.rename(tmp_link, os.path.join(folder, DATA_LINK))


def _new_folder(folder: str, name: str, text: str) -> str:
    fresh = tempfile.mkdtemp(prefix="..{}-".format(int(time.time())), dir=folder)
    atomic_write_text(os.path.join(fresh, name), text)
    os.chmod(fresh, 0o755)
    os.chmod(os.path.join(fresh, name), 0o644)
    return fresh


def write_override(path: str, text: str) -> None:
    """Swap the override file's content by renaming ``..data`` (see the module docstring)."""
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    data = os.path.join(folder, DATA_LINK)
    ours = os.path.join(DATA_LINK, name)
    stale = []
    if not os.path.islink(path) or os.readlink(path) != ours:
        # First update: the file is the user's (a regular file, or a link of theirs). Move to
        # the layout with its content unchanged (events test5 re-reads the same content on, or
        # ignores), so that the swap below is the one event that carries the new engine:
        # renaming ..data before the file is our link would make test5 read the old file.
        try:
            with open(path, "rb") as f:
                before = f.read(MAX_TEMPLATE).decode("utf-8", "replace")
        except OSError:
            before = None  # nothing there yet: test5 was not started on it
        if before is not None:
            if os.path.islink(data):
                stale.append(os.path.realpath(data))
            _swap_data(folder, _new_folder(folder, name, before))
        file_tmp = os.path.join(folder, "..{}_tmp".format(name))
        if os.path.lexists(file_tmp):
            os.unlink(file_tmp)
        os.symlink(ours, file_tmp)
        if before is None:
            _swap_data(folder, _new_folder(folder, name, text))
            os.rename(file_tmp, path)
            fsync_dir(folder)
            return
        os.rename(file_tmp, path)
    previous = os.path.realpath(data) if os.path.islink(data) else None
    fresh = _new_folder(folder, name, text)
    _swap_data(folder, fresh)
    fsync_dir(folder)
    for old in stale + [previous]:
        if old and os.path.dirname(old) == os.path.realpath(folder) and \
                old != os.path.realpath(fresh) and os.path.basename(old).startswith(".."):
            shutil.rmtree(old, ignore_errors=True)


def remove_override(path: str) -> None:
    folder = os.path.dirname(path)
    data = os.path.join(folder, DATA_LINK)
    target = os.path.realpath(data) if os.path.islink(data) else None
    for link in (path, data):
        if os.path.islink(link):
            os.unlink(link)
    if target and os.path.dirname(target) == os.path.realpath(folder):
        shutil.rmtree(target, ignore_errors=True)


class DeepStreamAdapter(Adapter):
    kind = "deepstream"

    def __init__(self, config: Optional[str] = None, override: Optional[str] = None,
                 template: Optional[str] = None, batch_size: int = 1, gpu_id: int = 0,
                 onnx_file: bool = False, int8_calib_file: Optional[str] = None,
                 single: Optional[Pipeline] = None,
                 pipelines: Optional[Dict[str, Pipeline]] = None, where: str = "handoff") -> None:
        if single is None and config is not None:
            single = Pipeline(config, override, template)
        self.single = single  # the top-level config: one name's (bind_models says which)
        self.single_name: Optional[str] = None
        self.pipelines = dict(pipelines or {})
        self.batch_size = batch_size
        self.gpu_id = gpu_id
        self.onnx_file = onnx_file
        self.int8_calib_file = int8_calib_file
        self.where = where

    def bind_models(self, models: List[str]) -> None:
        """The entry's ``models``: a top-level config serves exactly one name."""
        if self.single is None:
            return
        if len(models) != 1 or models[0] == "*":
            raise AgentError("bad_config", "{}.models: a top-level config is one pipeline, for "
                             "one model name: expected one name, found {!r} (give each name its "
                             "own config under pipelines:)".format(self.where, models))
        self.single_name = models[0]

    def pipeline(self, name: str) -> Pipeline:
        if name in self.pipelines:
            return self.pipelines[name]
        if self.single is not None and self.single_name in (None, name):
            return self.single
        configured = sorted(self.pipelines) or [self.single_name or "?"]
        raise AgentError("no_pipeline", "expected a model name with a DeepStream pipeline "
                         "configured ({}), found {!r}".format(", ".join(configured), name))

    def render(self, version: ModelVersion) -> Dict[str, str]:
        """{path: content} of the files this adapter writes for ``version``."""
        pipe = self.pipeline(version.name)
        keys = property_keys(version, self.batch_size, self.gpu_id, self.onnx_file,
                             self.int8_calib_file)
        files = {pipe.config: render_nvinfer(keys, pipe.template)}
        if pipe.override is not None:
            files[pipe.override] = render_override(pipe.config, version.engine)
        return files

    def _write(self, version: ModelVersion) -> None:
        pipe = self.pipeline(version.name)
        files = self.render(version)
        try:
            atomic_write_text(pipe.config, files[pipe.config])
            os.chmod(pipe.config, 0o644)
            if pipe.override is not None:
                write_override(pipe.override, files[pipe.override])
        except OSError as exc:
            raise AgentError("handoff_failed", "expected to write the DeepStream files of "
                             "{}@{} ({}), found {}".format(version.name, version.version,
                                                          ", ".join(files), exc))

    def check_compatible(self, new: ModelVersion, previous: Optional[ModelVersion]) -> None:
        """An on-the-fly update keeps the running engine's I/O (deepstream-test5 needs the
        same input resolution, architecture and class count): names, types and shapes."""
        if previous is None or not previous.meta or self.pipeline(new.name).override is None:
            return  # nothing running, or the app restarts on the new config
        old, fresh = signature(previous.meta), signature(new.meta)
        if old != fresh:
            raise AgentError("incompatible_engine", (
                "expected {}@{} to keep the inputs and outputs of the engine the pipeline runs "
                "({}@{}: {}) for an on-the-fly update, found {}").format(
                    new.name, new.version, previous.name, previous.version, describe(old),
                    describe(fresh)))

    def prepare(self, new: ModelVersion, previous: Optional[ModelVersion]) -> None:
        if not os.path.isfile(new.engine):
            raise AgentError("handoff_failed", "expected the engine of {}@{} at {}, found "
                             "none".format(new.name, new.version, new.engine))
        self.render(new)  # a version nvinfer can't be told about fails before any write
        self.check_compatible(new, previous)

    def switch(self, new: ModelVersion, previous: Optional[ModelVersion]) -> None:
        self._write(new)

    def confirm(self, new: ModelVersion) -> Optional[bool]:
        return None  # the app reports its health (client.report_health) or a probe decides

    def revert(self, previous: Optional[ModelVersion], failed: ModelVersion) -> None:
        if previous is not None:
            self._write(previous)
            return
        pipe = self.pipeline(failed.name)
        try:
            os.unlink(pipe.config)
        except FileNotFoundError:
            pass
        if pipe.override is not None:
            remove_override(pipe.override)
