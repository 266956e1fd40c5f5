"""Run the weight-sync service: `python -m launch.weight_sync [CONFIG] [--weight_sync.key VALUE ...]`.

Reads section `weight_sync:` of the run config (see `weight_sync/config.py` for every key).
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> None:
    from launch.config import ConfigError, load_section
    from weight_sync.config import WeightSyncConfig

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return
    config_path = argv.pop(0) if argv and not argv[0].startswith("--") else None
    try:
        cfg = load_section(WeightSyncConfig, "weight_sync", config_path, argv)
    except ConfigError as e:
        sys.exit(f"launch.weight_sync: {e}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from weight_sync.service import serve

    serve(cfg)


if __name__ == "__main__":
    main()
