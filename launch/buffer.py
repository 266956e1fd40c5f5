"""Run the replay buffer: `python -m launch.buffer [CONFIG.yaml] [--buffer.key VALUE ...] [--resume]`.

Conveyor's replay buffer: prompt leases under admission control, scored rollouts in, batches out
to learner ranks, and the rounds of evaluation during training. Reads sections `buffer:` and
`eval:` of the run config, applies the overrides, and serves
until SIGTERM/SIGINT (then writes its state and exits 0). Prints `buffer ready control=tcp://...
ingest=... relay_in=... relay_out=...` on stdout once its sockets are bound; logs go to stderr.

  --resume   require saved state in buffer.state_dir and continue from it (state that exists is
             resumed from even without this flag)
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from buffer.config import BufferConfig
    from launch.config import role_main_config

    cfg, path, flags = role_main_config(BufferConfig, "buffer", argv, __doc__, flags=("resume",))
    eval_cfg = eval_section(path)
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from buffer.service import ResumeError, serve
    from buffer.state import PromptsError
    from buffer.store import StateLocked
    from common.curve import KeyFolderError

    try:
        return serve(cfg, resume=flags["resume"], eval_cfg=eval_cfg)
    except (PromptsError, ResumeError, StateLocked, KeyFolderError) as e:
        print(f"launch.buffer: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a port already taken
        print(f"launch.buffer: {e}", file=sys.stderr)
        return 1


def eval_section(path: str | None):
    """The file's `eval:` section (evaluation during training), which the buffer serves too."""
    from buffer.config import EvalConfig
    from launch.config import ConfigError, load_section

    try:
        return load_section(EvalConfig, "eval", path)
    except ConfigError as e:
        print(f"launch.buffer: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    sys.exit(main())
