"""Reward-model training (Bradley-Terry): `python -m launch.rm [CONFIG] [--rm.KEY VALUE ...]`.

The `rm:` section of CONFIG fills learner.offline.config.RMConfig; a key is overridden as
`--rm.KEY VALUE`, `--KEY VALUE`, or with OpenRLHF's `train_rm` command line, flag by flag with the
same meaning (launch/openrlhf/offline.py): `--model.model_name_or_path`, `--data.dataset`,
`--data.chosen_key`, `--data.rejected_key`, `--train.batch_size`, `--adam.lr`,
`--model.loss_type sigmoid|logexpsigmoid`, `--model.margin_loss_enable`, `--ds.packing_samples`,
`--ckpt.output_dir`, ... and the underscore names of earlier releases (`--pretrain`, `--dataset`,
`--train_batch_size`, ...). On several ranks, `deepspeed --num_gpus 2 --module launch.rm rm.yaml`
or `torchrun --nproc_per_node 2 -m launch.rm rm.yaml` (NCCL on GPUs, gloo on CPU).

The saved folder is an AutoModelForSequenceClassification (num_labels=1, pad_token_id set) that
the scorer's `reward_model` kind loads as it is (`scorer.reward_model: DIR`).
"""

from __future__ import annotations

import sys

from launch.entry import role_main
from launch.openrlhf.offline import RM_ALIASES


def main(argv: list[str] | None = None) -> int:
    from learner.offline.config import RMConfig

    return role_main("rm", RMConfig, "learner.offline.rm:run", __doc__, argv, aliases=RM_ALIASES)


if __name__ == "__main__":
    sys.exit(main())
