"""Supervised fine-tuning: `python -m launch.sft [CONFIG] [--sft.KEY VALUE ...]`.

Several ranks with either launcher (DeepSpeed over NCCL on GPUs, gloo on CPU):

    deepspeed --num_gpus 2 --module launch.sft sft.yaml --sft.zero_stage 3
    torchrun --nproc_per_node 2 -m launch.sft sft.yaml

CONFIG is a YAML file whose `sft:` section fills learner.offline.config.SFTConfig; overrides are
`--sft.KEY VALUE` or `--KEY VALUE`. OpenRLHF's `train_sft` flags are accepted with the same meaning
(`--pretrain`, `--dataset`, `--input_key`, `--output_key`, `--max_len`, `--micro_train_batch_size`,
`--train_batch_size`, `--learning_rate`, `--bf16`, `--save_path`, `--save_steps`, `--logging_steps`,
`--max_epochs`, `--packing_samples`, ...). The trained model lands in save_path in HF format.

This file also holds the command line the three offline trainers share (launch.dpo, launch.rm).
"""

from __future__ import annotations

import sys

from common.config import Alias, ignored, renames
from launch.config import bf16
from launch.entry import role_main


def _save_steps(v: str) -> str:
    return "0" if int(float(v)) < 0 else v  # OpenRLHF: -1 = no intermediate checkpoints


# OpenRLHF flag -> key of the trainer's own section; shared by sft, dpo and rm
COMMON_ALIASES: dict[str, Alias] = {
    **renames(pretrain="model_path", dataset="dataset", eval_dataset="eval_dataset", max_samples="max_samples",
              max_len="max_len", micro_train_batch_size="micro_batch_size", train_batch_size="batch_size",
              learning_rate="lr", lr_warmup_ratio="warmup_ratio", l2="weight_decay", adam_betas="adam_betas",
              max_norm="max_grad_norm", zero_stage="zero_stage", gradient_checkpointing="gradient_checkpointing",
              save_path="save_path", ckpt_path="run_dir", logging_steps="log_every", max_ckpt_num="keep_checkpoints",
              load_checkpoint="resume", max_epochs="epochs", seed="seed", prompt_key="prompt_key",
              input_key="prompt_key", apply_chat_template="use_chat_template", lora_rank="lora_rank",
              lora_alpha="lora_alpha", lora_dropout="lora_dropout", target_modules="lora_target_modules"),
    "bf16": Alias(("dtype",), bf16),
    "save_steps": Alias(("save_every",), _save_steps),
    "eval_steps": Alias(("eval_every",), _save_steps),
    "flash_attn": ignored("the model's default attention implementation is used"),
}
SFT_ALIASES = {**COMMON_ALIASES, **renames(output_key="response_key", packing_samples="packing")}


def main(argv: list[str] | None = None) -> int:
    from learner.offline.config import SFTConfig

    return role_main("sft", SFTConfig, "learner.offline.sft:run", __doc__, argv, aliases=SFT_ALIASES)


if __name__ == "__main__":
    sys.exit(main())
