"""Run the replay buffer: `python -m launch.buffer [CONFIG.yaml] [--buffer.key VALUE ...] [--resume]`.

Reads section `buffer:` of the run config, applies the overrides, and serves until SIGTERM/SIGINT.
Prints `buffer ready control=tcp://... ingest=... relay_in=... relay_out=...` on stdout once its
sockets are bound; logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys

from buffer.config import BufferConfig
from launch.config import config_help


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch.buffer",
        usage="python -m launch.buffer [CONFIG.yaml] [--buffer.key VALUE ...] [--resume]",
        description="Conveyor's replay buffer: prompt leases under admission control, scored rollouts "
                    "in, batches out to learner ranks. Serves until SIGTERM/SIGINT (then writes its state "
                    "and exits 0).",
        epilog=config_help(BufferConfig, "buffer"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("config", nargs="?", help="run config (YAML); only its `buffer:` section is read")
    p.add_argument("--resume", action="store_true",
                   help="require saved state in buffer.state_dir and continue from it (state that exists "
                        "is resumed from even without this flag)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # argparse would take an override's value for the positional CONFIG: split by hand, let it do the help
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        return 0
    config = argv.pop(0) if argv and not argv[0].startswith("-") else None
    resume = "--resume" in argv
    overrides = [a for a in argv if a != "--resume"]

    from launch.config import ConfigError, load_section

    try:
        cfg = load_section(BufferConfig, "buffer", config, overrides)
    except ConfigError as e:
        print(f"launch.buffer: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from buffer.service import ResumeError, serve
    from buffer.state import PromptsError
    from buffer.store import StateLocked

    try:
        return serve(cfg, resume=resume)
    except (PromptsError, ResumeError, StateLocked) as e:
        print(f"launch.buffer: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a port already taken
        print(f"launch.buffer: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
