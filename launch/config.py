"""How each role's entry point reads its config, and where the addresses are tied together.

The parsing itself (`Section`, dotted overrides, aliases, the suggester, `--help`) is
`common.config`, re-exported here for the launchers. What this module adds knows the roles:

- `tie_addresses`: the one place a role that dials the buffer or the weight-sync service gets
  their addresses (`BufferAddress`, `WeightSyncAddress` sections) from the `buffer:` and
  `weight_sync:` sections: in a composed run always, for a role started alone only where its own
  section leaves them unset.
- `role_main_config`: `[CONFIG] [--section.key VALUE ...]` for one role, `--help` included.

Light on purpose: no torch, vllm or deepspeed here, so every `--help` answers at once.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from typing import Any, Iterable, Mapping, Sequence

from buffer.config import BufferAddress, BufferConfig
from common.config import (Alias, ConfigError, Section, apply_flags, build, ignored, is_set, load_section,
                           parse_bool, parse_overrides, read_yaml, renames, render_help, section_help,
                           set_dotted, split_argv, suggest, wants_help)
from weight_sync.config import WeightSyncAddress, WeightSyncConfig

__all__ = ["Alias", "ConfigError", "Section", "apply_flags", "bf16", "build", "config_help", "dump", "help_or_usage", "ignored",
           "is_set", "load_section", "parse_bool", "parse_overrides", "read_yaml", "renames", "render_help",
           "role_main_config", "set_dotted", "split_argv", "suggest", "tie_addresses", "wants_help"]


def help_or_usage(argv: Sequence[str], text) -> None:
    """An entry point given no arguments or `-h`/`--help` prints `text()` and exits (0 when asked, 2 when bare)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(text().rstrip())
        sys.exit(0 if argv else 2)


def tie_addresses(roles: Iterable[Section], buffer: BufferConfig | None, weight_sync: WeightSyncConfig | None,
                  only_unset: bool = False) -> None:
    """Write the buffer's and the weight-sync service's addresses into every role that dials them.

    `only_unset`: leave the keys a role's own section set (a role started alone by hand)."""
    for cfg in roles:
        pairs = []
        if buffer is not None and isinstance(cfg, BufferAddress):
            pairs += [("buffer_host", buffer.host), ("buffer_port", buffer.port)]
        if weight_sync is not None and isinstance(cfg, WeightSyncAddress):
            pairs += [("weight_sync_host", weight_sync.host), ("weight_sync_port", weight_sync.port)]
        for key, value in pairs:
            if not (only_unset and key in cfg.model_fields_set):
                setattr(cfg, key, value)


def role_main_config(cls: type[Section], section: str, argv: Sequence[str] | None, doc: str,
                     prog: str = "", flags: Sequence[str] = ()) -> tuple[Any, str | None, dict[str, bool]]:
    """(config, CONFIG path, the role's own boolean `flags`) from `[CONFIG] [--section.key VALUE ...]`.

    `--help` prints `doc` and every key of the section, then exits 0; a bad config prints the
    problem and exits 2. A role that dials the buffer takes its address from the file's `buffer:`
    section unless its own section sets it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or f"launch.{section}"
    # Before torch is imported anywhere in this role: torch.cuda.is_available() then asks NVML
    # instead of initialising the CUDA driver (torch/cuda/__init__.py, is_available), so a vLLM
    # engine core that vLLM forks from this process can still start CUDA (vLLM forks unless
    # torch.cuda.is_initialized(): vllm/utils/system_utils.py, _maybe_force_spawn). vLLM sets the
    # same variable only when imported (vllm/env_override.py), which may be too late.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if wants_help(argv):
        print(render_help(doc, {section: cls}, own=section), end="")
        sys.exit(0)
    # a native crash (libzmq's assertions, a segfault in an extension) prints every thread's Python
    # stack to the role's log instead of leaving only an exit status
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable()
        except (AttributeError, ValueError, OSError):  # a stderr with no file behind it (captured)
            pass
    path, rest = split_argv(argv)
    own_flags = {f"--{f}" for f in flags}
    given = {f: f"--{f}" in rest for f in flags}
    rest = [a for a in rest if a not in own_flags]
    try:
        cfg = load_section(cls, section, path, rest, complete=False)
        if isinstance(cfg, BufferAddress):
            tree = read_yaml(path)
            tie_addresses([cfg], build(BufferConfig, _address_keys(tree.get("buffer"))), None, only_unset=True)
        cfg.validate()
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        sys.exit(2)
    return cfg, path, given


def _address_keys(sub: Any) -> dict:
    """Only the address of another role's section: its other keys are that role's business."""
    return {k: sub[k] for k in ("host", "port") if isinstance(sub, Mapping) and k in sub}


def bf16(v: str) -> str:
    """OpenRLHF's `--bf16 [BOOL]` as a `dtype`."""
    return "bfloat16" if parse_bool(v) else "float32"


def config_help(cls: type[Section], section: str) -> str:
    """Every key of `cls` with its default, type and doc (kept for callers of the old name)."""
    return "\n".join(section_help(cls, section))


def dump(cfg: Section) -> dict:
    """A section as plain data (for logging and saving the resolved config)."""
    return cfg.to_dict()

