"""Scorer: `python -m launch.scorer [CONFIG] [--scorer.key VALUE ...]`.

Scores rollouts (rewards, reference log-probs) for the buffer. Reads section `scorer:` of CONFIG
(see actors/config.py for every key); the buffer's address defaults to the file's `buffer:`
section. Example:

    python -m launch.scorer run.yaml --scorer.kinds reward_fn,reference \\
        --scorer.reward_fn examples/rewards/arithmetic.py --scorer.reference /tmp/tiny
"""

from __future__ import annotations

import sys

from launch.entry import role_main


def main(argv: list[str] | None = None) -> int:
    from actors.config import ScorerConfig

    return role_main("scorer", ScorerConfig, "actors.scorer:run", __doc__, argv, identity="scorer")


if __name__ == "__main__":
    sys.exit(main())
