"""A run's CurveZMQ keys: `python -m launch.keys RUN_DIR [--names learner scorer ...]`.

Makes `RUN_DIR/keys` (mode 0700; secret files 0600) with the services' key pair and one pair per
client name (learner, scorer, admin by default; generators make their own on first use), keeping
any pair already there, and prints the line that hands the folder to a role started by hand:

    export CONVEYOR_KEYS=RUN_DIR/keys          # every role of the run
    export CONVEYOR_KEY_NAME=scorer-1          # optional: this process's identity

`launch.local` and `launch.ray` do this themselves when `run.curve` is on (common/curve.py says
what the keys protect).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common.curve import CLIENT_NAMES, KEYS_ENV, KeyFolderError, make_keys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.keys", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="the run's folder; the keys go to RUN_DIR/keys")
    p.add_argument("--names", nargs="+", default=list(CLIENT_NAMES),
                   help=f"client identities to make (default: {' '.join(CLIENT_NAMES)})")
    args = p.parse_args(argv)
    try:
        folder = make_keys(Path(args.run_dir).resolve() / "keys", tuple(args.names))
    except KeyFolderError as e:
        p.error(str(e))
    print(f"export {KEYS_ENV}={folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
