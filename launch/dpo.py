"""Direct preference optimisation (DPO, IPO, cDPO): `python -m launch.dpo [CONFIG] [--dpo.KEY VALUE ...]`.

Several ranks with either launcher (DeepSpeed over NCCL on GPUs, gloo on CPU):

    deepspeed --num_gpus 2 --module launch.dpo dpo.yaml --dpo.zero_stage 3
    torchrun --nproc_per_node 2 -m launch.dpo dpo.yaml

CONFIG is a YAML file whose `dpo:` section fills learner.offline.config.DPOConfig; overrides are
`--dpo.KEY VALUE` or `--KEY VALUE`. OpenRLHF's `train_dpo` quick-start flags are accepted with the
same meaning, e.g.

    python -m launch.dpo --pretrain MODEL_DIR --dataset pairs.jsonl --beta 0.1 --max_len 512 \\
        --micro_train_batch_size 1 --train_batch_size 64 --learning_rate 5e-7 --bf16 \\
        --save_path runs/dpo --save_steps -1 --logging_steps 1 --max_epochs 1

(`--ipo` selects the IPO loss, `--label_smoothing` cDPO, `--nll_loss_coef` the NLL term). The
trained model lands in save_path in HF format.
"""

from __future__ import annotations

import sys

from common.config import Alias, ignored, parse_bool, renames
from launch.entry import role_main
from launch.sft import COMMON_ALIASES

DPO_ALIASES = {
    **COMMON_ALIASES,
    "ipo": Alias(("loss",), lambda v: "ipo" if parse_bool(v) else "sigmoid"),
    **renames(nll_loss_coef="nll_coef", ref_pretrain="ref_path"),
    "ref_offload": ignored("use --ref_mode precompute to free the reference model"),
}


def main(argv: list[str] | None = None) -> int:
    from learner.offline.config import DPOConfig

    return role_main("dpo", DPOConfig, "learner.offline.dpo:run", __doc__, argv, aliases=DPO_ALIASES)


if __name__ == "__main__":
    sys.exit(main())
