"""DeepStream hand-off: the ``nvinfer`` config a DeepStream app reads, and the override file of
deepstream-test5's on-the-fly model update.

Owns two files named in the config: ``config`` (the nvinfer config: the user's ``template``, if
any, with the ``[property]`` keys below replaced, else a ``[property]`` group with only them) and,
optionally, ``override`` (the file passed to ``deepstream-test5-app -o``). Keys written:
``model-engine-file`` (the version folder's engine), ``network-mode`` (0 FP32, 1 INT8, 2 FP16,
from meta.json's precision), ``batch-size``, ``gpu-id``, ``int8-calib-file`` (INT8 only, when the
version folder holds ``calibration.cache`` or the config names one), ``enable-dla`` /
``use-dla-core`` (engines built for a DLA core), and ``onnx-file`` only with ``onnx_file: true``
(it lets nvinfer rebuild an engine nobody gated when the engine does not fit).

The override file is a deepstream-app config with a ``[primary-gie]`` group (``enable=1``,
``config-file``, ``model-engine-file``). test5 re-reads it on inotify events: a close-after-write
of that name, or a rename onto ``..data`` in its folder (the layout Kubernetes uses for mounted
config maps). A rename of the file itself triggers nothing, so the override is a symlink
``<file> -> ..data/<file>`` and ``..data`` a symlink to a hidden folder per update, swapped by
rename: atomic, and seen by test5. Keys and behaviour follow DeepStream 6.4 (Gst-nvinfer
configuration; deepstream-test5 on-the-fly model update; the same in 7.x).

``prepare`` checks the version and renders both files, ``switch`` writes them (the config first,
then the override, which is the step test5 acts on), ``confirm`` has no opinion (the app reports
health), ``revert`` writes the previous version's files (removes them when there is none).
"""

import os
import shutil
import tempfile
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple

from agent.device.handoff.base import Adapter, ModelVersion
from agent.device.models_dir import CALIBRATION
from agent.errors import AgentError
from agent.fsio import atomic_write_text, fsync_dir

KEYS = ("config", "template", "override", "batch_size", "gpu_id", "onnx_file", "int8_calib_file")
NETWORK_MODE = {"fp32": 0, "int8": 1, "fp16": 2}
MANAGED = ("model-engine-file", "network-mode", "batch-size", "gpu-id", "int8-calib-file",
           "enable-dla", "use-dla-core", "onnx-file")
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


def from_config(section: Mapping[str, Any], where: str) -> "DeepStreamAdapter":
    unknown = sorted(set(section) - set(KEYS))
    if unknown:
        raise _bad(where, unknown[0], "one of " + ", ".join(KEYS), unknown[0])
    onnx_file = section.get("onnx_file", False)
    if not isinstance(onnx_file, bool):
        raise _bad(where, "onnx_file", "true or false", onnx_file)
    config = _path(section, where, "config", required=True) or ""
    override = _path(section, where, "override")
    if override is not None and override == config:
        raise _bad(where, "override", "a file other than config", section.get("override"))
    template = _path(section, where, "template")
    template_text = None
    if template is not None:
        try:
            with open(template, "rb") as f:
                data = f.read(MAX_TEMPLATE + 1)
        except OSError as exc:
            raise _bad(where, "template", "a readable nvinfer config", "{}: {}".format(
                template, exc.strerror))
        if len(data) > MAX_TEMPLATE or b"\0" in data:
            raise _bad(where, "template", "a text nvinfer config of at most 1 MiB", template)
        template_text = data.decode("utf-8", "replace")
        if "[property]" not in (line.strip() for line in template_text.splitlines()):
            raise _bad(where, "template", "an nvinfer config with a [property] group", template)
    return DeepStreamAdapter(
        config=config, override=override, template=template_text,
        batch_size=_int(section, where, "batch_size", 1, 1, 1024),
        gpu_id=_int(section, where, "gpu_id", 0, 0, 64), onnx_file=onnx_file,
        int8_calib_file=_path(section, where, "int8_calib_file"))


def property_keys(version: ModelVersion, batch_size: int = 1, gpu_id: int = 0,
                  onnx_file: bool = False, int8_calib_file: Optional[str] = None
                  ) -> List[Tuple[str, str]]:
    """The ``[property]`` keys for ``version``, in the order they are written."""
    precision = str(version.meta.get("precision", "")).lower()
    if precision not in NETWORK_MODE:
        raise AgentError("handoff_failed", "meta.json of {}@{}: expected precision fp32, fp16 "
                         "or int8 for nvinfer's network-mode, found {!r}".format(
                             version.name, version.version, version.meta.get("precision")))
    keys = [("model-engine-file", version.engine),
            ("network-mode", str(NETWORK_MODE[precision])),
            ("batch-size", str(batch_size)), ("gpu-id", str(gpu_id))]
    if precision == "int8":
        in_folder = os.path.join(version.path, CALIBRATION)
        calib = in_folder if os.path.isfile(in_folder) else int8_calib_file
        if calib:
            keys.append(("int8-calib-file", calib))
    dla = (version.meta.get("portability") or {}).get("dla_core")
    if isinstance(dla, int) and not isinstance(dla, bool) and dla >= 0:
        keys += [("enable-dla", "1"), ("use-dla-core", str(dla))]
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


def write_override(path: str, text: str) -> None:
    """Swap the override file's content by renaming ``..data`` (see the module docstring)."""
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    fresh = tempfile.mkdtemp(prefix="..{}-".format(int(time.time())), dir=folder)
    atomic_write_text(os.path.join(fresh, name), text)
    os.chmod(fresh, 0o755)
    os.chmod(os.path.join(fresh, name), 0o644)
    data = os.path.join(folder, DATA_LINK)
    previous = os.path.realpath(data) if os.path.islink(data) else None
    tmp_link = os.path.join(folder, DATA_LINK + "_tmp")
    if os.path.lexists(tmp_link):
        os.unlink(tmp_link)
    os.symlink(os.path.basename(fresh), tmp_link)
    if not os.path.islink(path) or os.readlink(path) != os.path.join(DATA_LINK, name):
        file_tmp = os.path.join(folder, "..{}_tmp".format(name))
        if os.path.lexists(file_tmp):
            os.unlink(file_tmp)
        os.symlink(os.path.join(DATA_LINK, name), file_tmp)
        os.rename(tmp_link, data)
        os.rename(file_tmp, path)
    else:
        os.rename(tmp_link, data)
    fsync_dir(folder)
    if previous and os.path.dirname(previous) == os.path.realpath(folder) and \
            previous != os.path.realpath(fresh):
        shutil.rmtree(previous, ignore_errors=True)


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

    def __init__(self, config: str, override: Optional[str] = None,
                 template: Optional[str] = None, batch_size: int = 1, gpu_id: int = 0,
                 onnx_file: bool = False, int8_calib_file: Optional[str] = None) -> None:
        self.config = config
        self.override = override
        self.template = template
        self.batch_size = batch_size
        self.gpu_id = gpu_id
        self.onnx_file = onnx_file
        self.int8_calib_file = int8_calib_file

    def render(self, version: ModelVersion) -> Dict[str, str]:
        """{path: content} of the files this adapter writes for ``version``."""
        keys = property_keys(version, self.batch_size, self.gpu_id, self.onnx_file,
                             self.int8_calib_file)
        files = {self.config: render_nvinfer(keys, self.template)}
        if self.override is not None:
            files[self.override] = render_override(self.config, version.engine)
        return files

    def _write(self, version: ModelVersion) -> None:
        files = self.render(version)
        try:
            atomic_write_text(self.config, files[self.config])
            os.chmod(self.config, 0o644)
            if self.override is not None:
                write_override(self.override, files[self.override])
        except OSError as exc:
            raise AgentError("handoff_failed", "expected to write the DeepStream files of "
                             "{}@{} ({}), found {}".format(version.name, version.version,
                                                          ", ".join(files), exc))

    def prepare(self, new: ModelVersion, previous: Optional[ModelVersion]) -> None:
        if not os.path.isfile(new.engine):
            raise AgentError("handoff_failed", "expected the engine of {}@{} at {}, found "
                             "none".format(new.name, new.version, new.engine))
        self.render(new)  # a version nvinfer can't be told about fails before any write

    def switch(self, new: ModelVersion, previous: Optional[ModelVersion]) -> None:
        self._write(new)

    def confirm(self, new: ModelVersion) -> Optional[bool]:
        return None  # the app reports its health (client.report_health) or a probe decides

    def revert(self, previous: Optional[ModelVersion], failed: ModelVersion) -> None:
        if previous is not None:
            self._write(previous)
            return
        for path in (self.config,):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if self.override is not None:
            remove_override(self.override)
