"""Reward-model training (Bradley-Terry): `python -m launch.rm [CONFIG] [--rm.KEY VALUE ...]`.

The `rm:` section of CONFIG fills learner.offline.config.RMConfig; a key is overridden as
`--rm.KEY VALUE`, `--KEY VALUE`, or with OpenRLHF's `train_rm` flags (`--pretrain`, `--dataset`,
`--chosen_key`, `--rejected_key`, `--max_len`, `--micro_train_batch_size`, `--train_batch_size`,
`--learning_rate`, `--bf16`, `--save_path`, `--save_steps`, `--logging_steps`, `--max_epochs`, ...).
On several ranks, `deepspeed --num_gpus 2 --module launch.rm rm.yaml` or `torchrun
--nproc_per_node 2 -m launch.rm rm.yaml` (NCCL on GPUs, gloo on CPU).

The saved folder is an AutoModelForSequenceClassification (num_labels=1, pad_token_id set) that
the scorer's `reward_model` kind loads as it is (`scorer.reward_model: DIR`).
"""

from __future__ import annotations

import sys

from common.config import ignored
from launch.entry import role_main
from launch.sft import COMMON_ALIASES

RM_ALIASES = {
    **COMMON_ALIASES,
    "value_head_prefix": ignored("the head is the architecture's own `score` layer"),
}


def main(argv: list[str] | None = None) -> int:
    from learner.offline.config import RMConfig

    return role_main("rm", RMConfig, "learner.offline.rm:run", __doc__, argv, aliases=RM_ALIASES)


if __name__ == "__main__":
    sys.exit(main())
