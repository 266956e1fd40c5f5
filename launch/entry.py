"""The entry point every role shares: `python -m launch.<role>` is a docstring and one call of `role_main`.

    def main(argv: list[str] | None = None) -> int:
        from actors.config import ScorerConfig

        return role_main("scorer", ScorerConfig, "actors.scorer:run", __doc__, argv, identity="scorer")

`role_main` does for every role what comes before and after its `run(cfg, stop=None) -> int`:

- the command line, `[CONFIG] [--section.key VALUE ...]` (`role_config`): `--help` prints the
  module's docstring and every key of the section; the offline trainers also take bare keys and
  OpenRLHF's flags (their `aliases`). A role that dials the buffer takes its address from the
  file's `buffer:` section unless its own section sets it;
- the process's CurveZMQ key name (`common.curve.default_identity`), for a role that has one;
- one log format for every role, on stderr (`LOG_FORMAT`);
- the exit code: the one `run` returns, or for a known error (a bad config, key folder, saved
  state, prompt file, environment or dataset: `KNOWN_ERRORS`) its message in one line and the
  code `launch.recovery.EXIT_CODES` gives it. A full disk (`common.disk.OutOfDisk`: exit code 9)
  first deletes the launcher's reserve file, so that the line naming the path reaches the log.

Light on purpose: the role's own module (torch, vllm, deepspeed) is imported only once its config
is read, so every `--help` answers at once.
"""

from __future__ import annotations

import faulthandler
import importlib
import logging
import os
import sys
from typing import Any, Callable, Mapping, Sequence

from buffer.config import BufferAddress, BufferConfig
from common.config import Alias, Section, build, load_section, read_yaml, render_help, split_argv, wants_help
from common.curve import default_identity
from common.disk import release_reserve
from launch.config import tie_addresses
from launch.recovery import EXIT_CODES

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Errors a role reports in one line, by the class's `module:name`, with the key of their exit code in
# EXIT_CODES. A class is looked up only where its module is loaded already (an error of a module
# that was never imported cannot have been raised), so naming one here imports nothing.
KNOWN_ERRORS = {
    "common.config:ConfigError": "config",
    "common.curve:KeyFolderError": "config",
    "common.datasets:DatasetError": "config",
    "buffer.prompts:PromptsError": "config",
    "buffer.service:ResumeError": "config",
    "buffer.store:StateLocked": "config",
    "actors.envs.api:EnvLoadError": "config",
    "learner.offline.loop:SetupError": "config",
    "common.disk:OutOfDisk": "disk",
}


def role_main(section: str, cls: type[Section], run: str, doc: str, argv: Sequence[str] | None = None, *,
              flags: Sequence[str] = (), aliases: Mapping[str, Alias] | None = None,
              identity: str | Callable[[Any], str] | None = None,
              more: Callable[[Any, str | None], dict[str, Any]] | None = None,
              failed: tuple[type[BaseException], ...] = ()) -> int:
    """Read the role's config, set its process up and call `run(cfg, **kwargs)`; the exit code.

    section, cls: the role's section of the run config and its class;
    run: the role's `run` as `module:function`, imported once the config is read;
    doc: the entry point's docstring (its usage), which `--help` prints before the keys;
    flags: the role's own boolean flags (`resume` for `--resume`), passed to `run` by name;
    aliases: OpenRLHF's flags, for the offline trainers (see `role_config`);
    identity: the process's CurveZMQ key name, or the function of the config that gives it;
    more: (config, CONFIG path) -> more keyword arguments of `run` (another section of the file);
    failed: more errors said in one line, with exit code EXIT_CODES["failed"] (a port already taken).
    """
    prog = f"launch.{section}"
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(render_help(doc, {section: cls}, aliases, own=section), end="")
        return 0
    enable_faulthandler()
    path, _ = split_argv(argv)
    kwargs: dict[str, Any] = {f: f"--{f}" in argv for f in flags}
    argv = [a for a in argv if a not in {f"--{f}" for f in flags}]
    try:
        cfg = role_config(cls, section, argv, aliases)
        if more is not None:
            kwargs.update(more(cfg, path))
        if identity is not None:
            default_identity(identity(cfg) if callable(identity) else identity)
        setup_logging(getattr(cfg, "log_level", "info"))
        module, _, name = run.partition(":")
        return getattr(importlib.import_module(module), name)(cfg, **kwargs)
    except Exception as e:
        kind = known_error(e) or ("failed" if isinstance(e, failed) else None)
        if kind is None:
            raise
        if kind == "disk":
            release_reserve()  # (room for this line, and for the launcher's)
        try:
            print(f"{prog}: {e}", file=sys.stderr, flush=True)
        except OSError:  # (a full disk and no reserve: the exit code says it)
            pass
        return EXIT_CODES[kind]


def role_config(cls: type[Section], section: str, argv: Sequence[str], aliases: Mapping[str, Alias] | None = None):
    """The role's config from `[CONFIG] [--section.key VALUE ...]`; raises ConfigError.

    A role that dials the buffer takes its address from the file's `buffer:` section unless its own
    section sets it. With `aliases` (an offline trainer), `--KEY VALUE` sets a key of the section
    and OpenRLHF's flags are read as the aliases say; what is missing is said with what is wrong."""
    # Before torch is imported anywhere in this role: torch.cuda.is_available() then asks NVML
    # instead of initialising the CUDA driver (torch/cuda/__init__.py, is_available), so a vLLM
    # engine core that vLLM forks from this process can still start CUDA (vLLM forks unless
    # torch.cuda.is_initialized(): vllm/utils/system_utils.py, _maybe_force_spawn). vLLM sets the
    # same variable only when imported (vllm/env_override.py), which may be too late.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    path, rest = split_argv(argv)
    if aliases is not None:
        return load_section(cls, section, path, rest, aliases)
    cfg = load_section(cls, section, path, rest, complete=False)
    if isinstance(cfg, BufferAddress):
        buffer = read_yaml(path).get("buffer")  # (its address only: its other keys are the buffer's business)
        address = {k: buffer[k] for k in ("host", "port") if isinstance(buffer, Mapping) and k in buffer}
        tie_addresses([cfg], build(BufferConfig, address), None, only_unset=True)
    return cfg.validate()


def setup_logging(level: str = "info") -> None:
    """Every role's log lines on stderr, in one format: `time LEVEL logger: message`."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format=LOG_FORMAT)


def enable_faulthandler() -> None:
    """A native crash (libzmq's assertions, a segfault in an extension) prints every thread's Python
    stack to the role's log instead of leaving only an exit status."""
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable()
        except (AttributeError, ValueError, OSError):  # a stderr with no file behind it (captured)
            pass


def known_error(e: BaseException) -> str | None:
    """The EXIT_CODES key of `e` if it is one of KNOWN_ERRORS, else None."""
    for dotted, kind in KNOWN_ERRORS.items():
        module, _, name = dotted.partition(":")
        loaded = sys.modules.get(module)
        if loaded is not None and isinstance(e, getattr(loaded, name)):
            return kind
    return None
