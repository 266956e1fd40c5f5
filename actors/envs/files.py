"""Python files and modules named in config (`path/file.py:name`, `package.module:name`), imported.

A file is executed as a module of its own; one that mentions `openrlhf` runs with OpenRLHF's agent
module stood in (actors/envs/openrlhf_agent.py), so OpenRLHF agent and reward files run unchanged.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from contextlib import nullcontext
from pathlib import Path

from actors.envs.api import EnvLoadError
from actors.envs.openrlhf_agent import openrlhf_standin
from common import moved

REPO = Path(__file__).resolve().parents[2]


def load_object(spec: str, where: str):
    """The object `name` of `path/file.py:name` (absolute, or relative to the working directory or
    the repository) or `package.module:name`; errors quote `where`."""
    source, sep, name = spec.rpartition(":")
    if not sep or not source or not name.isidentifier():
        raise EnvLoadError(f"{where}: expected path/file.py:name or package.module:name, got {spec!r}")
    path = Path(source) if Path(source).is_absolute() or Path(source).exists() else REPO / source
    if source.endswith(".py"):
        if not path.is_file():
            raise EnvLoadError(f"{where}: no such file {source!r}")
        module = exec_file(path, where)
    else:
        try:
            module = moved.import_module(source)
        except ImportError as e:
            raise EnvLoadError(f"{where}: importing module {source!r} failed: {e}") from None
    if not hasattr(module, name):
        raise EnvLoadError(f"{where}: {source} defines no {name!r}")
    return getattr(module, name)


def exec_file(path: Path, where: str) -> types.ModuleType:
    """Import a Python file as a module of its own (registered in sys.modules, as dataclasses need)."""
    name = f"conveyor_env_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with openrlhf_standin() if "openrlhf" in path.read_text(errors="replace") else nullcontext():
            spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise EnvLoadError(f"{where}: importing {path} raised {type(e).__name__}: {e}") from None
    return module
