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

import sys

from common.config import load_section
from launch.entry import role_main


def main(argv: list[str] | None = None) -> int:
    from buffer.config import BufferConfig

    return role_main("buffer", BufferConfig, "buffer.service:run", __doc__, argv, flags=("resume",),
                     more=eval_section, failed=(OSError,))  # (OSError: a port already taken)


def eval_section(cfg, path: str | None) -> dict:
    """The file's `eval:` section (evaluation during training), which the buffer serves too."""
    from buffer.config import EvalConfig

    return {"eval_cfg": load_section(EvalConfig, "eval", path)}


if __name__ == "__main__":
    sys.exit(main())
