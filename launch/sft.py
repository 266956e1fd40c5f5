"""Supervised fine-tuning: `python -m launch.sft [CONFIG] [--sft.KEY VALUE ...]`.

Several ranks with either launcher (DeepSpeed over NCCL on GPUs, gloo on CPU):

    deepspeed --num_gpus 2 --module launch.sft sft.yaml --sft.zero_stage 3
    torchrun --nproc_per_node 2 -m launch.sft sft.yaml

CONFIG is a YAML file whose `sft:` section fills learner.offline.config.SFTConfig; overrides are
`--sft.KEY VALUE` or `--KEY VALUE`. OpenRLHF's `train_sft` command line is accepted as it is, flag
by flag with the same meaning (launch/openrlhf/offline.py), e.g.

    python -m launch.sft --model.model_name_or_path MODEL_DIR --data.dataset chats.jsonl \\
        --data.input_key question --data.output_key response --data.max_len 2048 \\
        --train.batch_size 128 --train.micro_batch_size 8 --adam.lr 5e-6 --ds.param_dtype bf16 \\
        --ds.packing_samples --ckpt.output_dir runs/sft --ckpt.save_steps -1 --train.max_epochs 1

and the underscore names of earlier releases (`--pretrain`, `--dataset`, `--train_batch_size`, ...).
`--model.pretrain_mode_enable` trains on every token of plain texts (continued pre-training). The
trained model lands in save_path in HF format.
"""

from __future__ import annotations

import sys

from launch.entry import role_main
from launch.openrlhf.offline import SFT_ALIASES


def main(argv: list[str] | None = None) -> int:
    from learner.offline.config import SFTConfig

    return role_main("sft", SFTConfig, "learner.offline.sft:run", __doc__, argv, aliases=SFT_ALIASES)


if __name__ == "__main__":
    sys.exit(main())
