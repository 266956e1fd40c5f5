"""Run the weight-sync service: `python -m launch.weight_sync [CONFIG] [--weight_sync.key VALUE ...]`.

Reads section `weight_sync:` of the run config (see `weight_sync/config.py` for every key) and
serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> None:
    from launch.config import role_main_config
    from weight_sync.config import WeightSyncConfig

    cfg, _, _ = role_main_config(WeightSyncConfig, "weight_sync", argv, __doc__)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from common.curve import KeyFolderError
    from weight_sync.service import serve

    try:
        serve(cfg)
    except KeyFolderError as e:
        print(f"launch.weight_sync: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
