"""Rollout generator: `python -m launch.generator [CONFIG] [--generator.key VALUE ...]`.

Samples rollouts of leased prompts and pushes them to the scorers. Reads section `generator:` of
CONFIG (see actors/config.py for every key); the buffer's address defaults to the file's
`buffer:` section. Example:

    python -m launch.generator run.yaml --generator.model /tmp/tiny --generator.engine transformers
"""

from __future__ import annotations

import logging
import os
import socket
import sys

from common.curve import default_identity


def main(argv: list[str] | None = None) -> None:
    from actors.config import GeneratorConfig
    from launch.config import role_main_config

    cfg, _, _ = role_main_config(GeneratorConfig, "generator", argv, __doc__)
    if not cfg.worker_id:  # (one name for its leases, its weight rounds and its CurveZMQ key)
        cfg.worker_id = f"gen-{socket.gethostname()}-{os.getpid()}"
    default_identity(cfg.worker_id)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s generator %(levelname)s %(message)s")
    from actors.envs.api import EnvLoadError
    from actors.generator import run_generator

    try:
        sys.exit(run_generator(cfg))
    except EnvLoadError as e:
        print(f"launch.generator: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":  # vLLM spawns its engine process: this guard is required
    main()
