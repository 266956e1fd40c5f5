"""Run the replay buffer: `python -m launch.buffer [CONFIG.yaml] [--buffer.key VALUE ...] [--resume]`.

Conveyor's replay buffer: prompt leases under admission control, scored rollouts in, batches out
to learner ranks. Reads section `buffer:` of the run config, applies the overrides, and serves
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

    cfg, _, flags = role_main_config(BufferConfig, "buffer", argv, __doc__, flags=("resume",))
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from buffer.service import ResumeError, serve
    from buffer.state import PromptsError
    from buffer.store import StateLocked

    try:
        return serve(cfg, resume=flags["resume"])
    except (PromptsError, ResumeError, StateLocked) as e:
        print(f"launch.buffer: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a port already taken
        print(f"launch.buffer: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
