"""Where the addresses of a run's roles are tied together, and the pieces of the launchers' command lines.

The parsing itself (`Section`, dotted overrides, aliases, the suggester, `--help`) is
`common.config`; a role's own entry point reads its section through `launch.entry`. What this
module adds knows the roles:

- `tie_addresses`: the one place a role that dials the buffer or the weight-sync service gets
  their addresses (`BufferAddress`, `WeightSyncAddress` sections) from the `buffer:` and
  `weight_sync:` sections: in a composed run always, for a role started alone only where its own
  section leaves them unset.
- `help_or_usage`: the launchers' `--help` (and their usage when given no arguments).
- `bf16`: OpenRLHF's `--bf16` as a `dtype`.

Light on purpose: no torch, vllm or deepspeed here, so every `--help` answers at once.
"""

from __future__ import annotations

import sys
from typing import Iterable, Sequence

from buffer.config import BufferAddress, BufferConfig
from common.config import Section, parse_bool
from weight_sync.config import WeightSyncAddress, WeightSyncConfig


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


def bf16(v: str) -> str:
    """OpenRLHF's `--bf16 [BOOL]` as a `dtype`."""
    return "bfloat16" if parse_bool(v) else "float32"
