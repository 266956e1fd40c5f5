"""Rollout generator: `python -m launch.generator [CONFIG] [--generator.key VALUE ...]`.

Samples rollouts of leased prompts and pushes them to the scorers. Reads section `generator:` of
CONFIG (see actors/config.py for every key); the buffer's address defaults to the file's
`buffer:` section. Example:

    python -m launch.generator run.yaml --generator.model /tmp/tiny --generator.engine transformers
"""

from __future__ import annotations

import os
import socket
import sys

from launch.entry import role_main


def main(argv: list[str] | None = None) -> int:
    from actors.config import GeneratorConfig

    return role_main("generator", GeneratorConfig, "actors.generator:run", __doc__, argv, identity=worker_name)


def worker_name(cfg) -> str:
    """One name for the generator's leases, its weight rounds and its CurveZMQ key: `generator.worker_id`,
    made up here when it is not set."""
    if not cfg.worker_id:
        cfg.worker_id = f"gen-{socket.gethostname()}-{os.getpid()}"
    return cfg.worker_id


if __name__ == "__main__":  # vLLM spawns its engine process: this guard is required
    sys.exit(main())
