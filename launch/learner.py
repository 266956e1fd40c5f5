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

from common.config import load_section
from launch.entry import role_main


def main(argv: list[str] | None = None) -> int:
    from learner.config import LearnerConfig

    return role_main("learner", LearnerConfig, "learner.trainer:run", __doc__, argv, identity="learner",
                     more=weight_sync_section)


def weight_sync_section(cfg, path: str | None) -> dict:
    """The sender's knobs from the file's `weight_sync:` section, when the learner publishes weights."""
    from weight_sync.config import WeightSyncConfig

    return {"weight_sync": load_section(WeightSyncConfig, "weight_sync", path) if cfg.weight_sync_port else None}


if __name__ == "__main__":
    sys.exit(main())
