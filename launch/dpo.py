"""Direct preference optimisation (DPO, IPO, cDPO): `python -m launch.dpo [CONFIG] [--dpo.KEY VALUE ...]`.

Several ranks with either launcher (DeepSpeed over NCCL on GPUs, gloo on CPU):

    deepspeed --num_gpus 2 --module launch.dpo dpo.yaml --dpo.zero_stage 3
    torchrun --nproc_per_node 2 -m launch.dpo dpo.yaml

CONFIG is a YAML file whose `dpo:` section fills learner.offline.config.DPOConfig; overrides are
`--dpo.KEY VALUE` or `--KEY VALUE`. OpenRLHF's `train_dpo` command line is accepted as it is, flag
by flag with the same meaning (launch/openrlhf/offline.py), e.g.

    python -m launch.dpo --model.model_name_or_path MODEL_DIR --data.dataset pairs.jsonl \\
        --data.prompt_key prompt --data.chosen_key chosen --data.rejected_key rejected \\
        --model.beta 0.1 --data.max_len 512 --train.micro_batch_size 1 --train.batch_size 64 \\
        --adam.lr 5e-7 --ds.param_dtype bf16 --ckpt.output_dir runs/dpo --ckpt.save_steps -1

and the underscore names of earlier releases (`--pretrain`, `--beta`, `--ipo`, ...).
`--model.ipo_enable` selects the IPO loss, `--model.label_smoothing` cDPO, `--model.nll_loss_coef`
the NLL term, `--ds.packing_samples` packs each micro-batch into one row. The trained model lands
in save_path in HF format.
"""

from __future__ import annotations

import sys

from launch.entry import role_main
from launch.openrlhf.offline import DPO_ALIASES


def main(argv: list[str] | None = None) -> int:
    from learner.offline.config import DPOConfig

    return role_main("dpo", DPOConfig, "learner.offline.dpo:run", __doc__, argv, aliases=DPO_ALIASES)


if __name__ == "__main__":
    sys.exit(main())
