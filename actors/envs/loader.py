"""Naming an environment in config: `load_env(spec, kwargs)`, the spec as actors/envs/api.py lists it."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any, Callable

from actors.envs.agent_executor import load_executor, own_execute
from actors.envs.api import EnvLoadError, brief
from actors.envs.arena import textarena_env
from actors.envs.files import REPO, exec_file
from actors.envs.openrlhf_agent import AgentInstanceBase, OpenRLHFAgent, agent_class
from actors.envs.tool_env import tool_env
from common import moved

NAMED_ENVS = {"guess": "examples/envs/guess.py:GuessEnv"}  # name -> spec, paths relative to REPO


def load_env(spec: str, kwargs: dict | None = None, key: str = "env") -> Callable[[], Any]:
    """A factory of fresh environments (one per episode) from `spec` (see the module docstring);
    errors quote `key`, the config key that holds the spec. An OpenRLHF file whose `AgentExecutor`
    has its own `execute` gives an `ExecutorEpisodes` instead (actors/envs/agent_executor.py): it
    plays each episode itself, against the engine."""
    kwargs = dict(kwargs or {})
    where = f"{key}={spec!r}"
    if spec == "tools":
        return tool_env(kwargs, where)
    if spec.startswith("textarena:"):
        return textarena_env(spec.removeprefix("textarena:"), kwargs, where)
    spec = NAMED_ENVS.get(spec, spec)
    source, sep, name = spec.rpartition(":")
    if not sep or not name.isidentifier():  # no class named: an OpenRLHF agent file
        source, name = spec, ""
    path = Path(source) if Path(source).is_absolute() or Path(source).exists() else REPO / source
    if source.endswith(".py") or path.is_file():
        if not path.is_file():
            raise EnvLoadError(f"{where}: no such file {source!r}" + (f" (nor {path})" if path != Path(source) else ""))
        module = exec_file(path, where)
    elif not name:
        raise EnvLoadError(f"{where}: neither a file, nor module:Class, nor a name of {sorted(NAMED_ENVS)}, "
                           "'tools' or 'textarena:GameId'")
    else:
        try:
            module = moved.import_module(source)
        except ImportError as e:
            raise EnvLoadError(f"{where}: no such file, and importing module {source!r} failed: {e}") from None
    if name:
        cls = getattr(module, name, None)
    else:  # as OpenRLHF: the file's AgentExecutor, whose execute plays the episode or its AgentInstance
        executor = getattr(module, "AgentExecutor", None)
        cls = executor if own_execute(executor) else agent_class(module, where)
    if cls is None:
        classes = sorted(k for k, v in vars(module).items() if isinstance(v, type) and v.__module__ == module.__name__)
        raise EnvLoadError(f"{where}: {source} defines no {name!r} (its classes: {', '.join(classes) or 'none'})")
    if not isinstance(cls, type):
        raise EnvLoadError(f"{where}: {name} is {brief(cls)}, not a class")
    _check_signature(cls, kwargs, where)
    if own_execute(cls):
        return load_executor(cls, kwargs, where)
    if issubclass(cls, AgentInstanceBase):
        return functools.partial(OpenRLHFAgent, cls, kwargs)
    for method in ("reset", "step"):
        fn = getattr(cls, method, None)
        if not callable(fn):
            raise EnvLoadError(f"{where}: {name} has no {method}() method")
        try:
            inspect.signature(fn).bind(None, None)  # self, and the row or the action
        except TypeError:
            raise EnvLoadError(f"{where}: {name}.{method}{inspect.signature(fn)} must take one argument "
                               f"besides self ({'the row' if method == 'reset' else 'the action text'})") from None
    return functools.partial(cls, **kwargs)


def _check_signature(cls: type, kwargs: dict, where: str) -> None:
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise EnvLoadError(f"{where}: {cls.__name__}{inspect.signature(cls)} cannot take "
                           f"the environment's arguments {kwargs}: {e}") from None
    except ValueError:  # no signature to read (a builtin): leave it to the first episode
        pass
