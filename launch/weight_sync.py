"""Run the weight-sync service: `python -m launch.weight_sync [CONFIG] [--weight_sync.key VALUE ...]`.

Reads section `weight_sync:` of the run config (see `weight_sync/config.py` for every key) and
serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import sys

from launch.entry import role_main


def main(argv: list[str] | None = None) -> int:
    from weight_sync.config import WeightSyncConfig

    return role_main("weight_sync", WeightSyncConfig, "weight_sync.service:run", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
