"""A models directory laid out as the daemon's activation writes it (docs: the issue-21
contract): ``<models_dir>/<name>/<version>/{model.engine, meta.json}`` with the engine a hard
link to the cache entry's file (or a copy, as across file systems) and ``<name>/current`` a
relative symlink to the active version. For tests of what reads it (protection, health)."""

import hashlib
import json
import os
import shutil


def add_version(models_dir, name, version, engine_src, engine_key, link=True, current=False,
                **meta_overrides):
    """Create ``<models_dir>/<name>/<version>``; returns its path."""
    path = os.path.join(str(models_dir), name, version)
    os.makedirs(path)
    engine = os.path.join(path, "model.engine")
    if link:
        os.link(engine_src, engine)
    else:
        shutil.copyfile(engine_src, engine)
    with open(engine, "rb") as f:
        data = f.read()
    meta = {"name": name, "version": version, "model_sha256": "0" * 64,
            "engine_key": engine_key, "precision": "fp32", "job_id": "j-" + version,
            "activated": 1700000000.0, "state": "committed",
            "engine_sha256": hashlib.sha256(data).hexdigest(), "engine_size": len(data)}
    meta.update(meta_overrides)
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)
    if current:
        set_current(models_dir, name, version)
    return path


def set_current(models_dir, name, version):
    link = os.path.join(str(models_dir), name, "current")
    tmp = link + ".new"
    os.symlink(version, tmp)
    os.replace(tmp, link)
