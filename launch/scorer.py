"""Scorer: `python -m launch.scorer [CONFIG] [--scorer.key VALUE ...]`.

Scores rollouts (rewards, reference log-probs) for the buffer. Reads section `scorer:` of CONFIG
(see actors/config.py for every key); the buffer's address defaults to the file's `buffer:`
section. Example:

    python -m launch.scorer run.yaml --scorer.kinds reward_fn,reference \\
        --scorer.reward_fn examples/rewards/arithmetic.py --scorer.reference /tmp/tiny
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> None:
    from actors.config import ScorerConfig
    from launch.config import role_main_config

    cfg, _, _ = role_main_config(ScorerConfig, "scorer", argv, __doc__)
    from common.curve import default_identity

    default_identity("scorer")  # (its CurveZMQ key, when the run has keys)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s scorer %(levelname)s %(message)s")
    from actors.scorer import run_scorer

    sys.exit(run_scorer(cfg))


if __name__ == "__main__":
    main()
