"""Learner ranks: `python -m launch.learner [CONFIG] [--learner.KEY VALUE ...]`.

One process per rank; start several with either launcher (both checked on CPU with gloo):

    deepspeed --num_gpus 2 --module launch.learner run.yaml --learner.zero_stage 3
    torchrun --nproc_per_node 2 -m launch.learner run.yaml --learner.zero_stage 3

Plain `python -m launch.learner` is a world of one. The buffer address defaults to the `buffer:`
section of the same file; when `learner.weight_sync_port` is set, the sender's knobs (bucket size,
backend, join timeout) come from its `weight_sync:` section. Rank 0 says it is ready once the
engine is built.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from launch.config import ConfigError, load_section, role_main_config
    from learner.config import LearnerConfig
    from weight_sync.config import WeightSyncConfig

    cfg, path, _ = role_main_config(LearnerConfig, "learner", argv, __doc__)
    from common.curve import default_identity

    default_identity("learner")  # (its CurveZMQ key, when the run has keys)
    weight_sync = None
    if cfg.weight_sync_port:
        try:
            weight_sync = load_section(WeightSyncConfig, "weight_sync", path)
        except ConfigError as e:
            print(f"launch.learner: {e}", file=sys.stderr)
            sys.exit(2)

    from learner.trainer import run

    run(cfg, weight_sync=weight_sync)


if __name__ == "__main__":
    main()
