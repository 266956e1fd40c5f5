"""Rollout generator: `python -m launch.generator [CONFIG] [--generator.key VALUE ...]`.

Reads section `generator:` of CONFIG (see actors/config.py for every key); the buffer's address
defaults to the file's `buffer:` section. Example:

    python -m launch.generator run.yaml --generator.model /tmp/tiny --generator.engine transformers
"""

from __future__ import annotations

import argparse
import logging
import sys

from launch.config import config_help


def role_config(cls: type, section: str, argv: list[str] | None, description: str):
    """Parse `[CONFIG] [--section.key VALUE ...]` into `cls`; `buffer_host`/`buffer_port` default to
    the file's `buffer:` section so a run config states the buffer's address once."""
    from launch.config import ConfigError, load_section, parse_overrides, read_yaml

    p = argparse.ArgumentParser(prog=f"python -m launch.{section}", description=description,
                                usage=f"python -m launch.{section} [CONFIG.yaml] [--{section}.key VALUE ...]",
                                epilog=config_help(cls, section), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="run config YAML (optional)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        p.print_help()
        sys.exit(0)
    # The config file, when given, comes first; everything after it is overrides.
    config, rest = (argv[0], argv[1:]) if argv and not argv[0].startswith("--") else (None, argv)
    try:
        tree = read_yaml(config)
        own = tree.get(section) or {}
        buf = tree.get("buffer") or {}
        overrides = {f"{section}.buffer_{k}": buf[k] for k in ("host", "port")
                     if k in buf and f"buffer_{k}" not in own}
        overrides.update(parse_overrides(rest))
        return load_section(cls, section, config, overrides)
    except ConfigError as e:
        p.error(str(e))


def main(argv: list[str] | None = None) -> None:
    from actors.config import GeneratorConfig

    cfg = role_config(GeneratorConfig, "generator", argv, "Sample rollouts of leased prompts and push them to the scorers.")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s generator %(levelname)s %(message)s")
    from actors.generator import run_generator

    sys.exit(run_generator(cfg))


if __name__ == "__main__":  # vLLM spawns its engine process: this guard is required
    main()
