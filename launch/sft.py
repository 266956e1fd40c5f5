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

from launch.config import Alias, bf16, ignored, renames


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


def parse_offline(cls: type, section: str, aliases: dict, argv: list[str]):
    """The config of one offline trainer: YAML section, then overrides (dotted, bare or OpenRLHF)."""
    from launch.config import load_section, split_argv

    config_path, rest = split_argv(argv)
    return load_section(cls, section, config_path, rest, aliases)


def offline_main(prog: str, cls: type, section: str, aliases: dict, doc: str, run_name: str,
                 argv: list[str] | None) -> int:
    """Parse, then call learner.<run_name>.run; exit code 2 for a bad config or dataset."""
    from launch.config import ConfigError, render_help, wants_help

    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(render_help(doc, {section: cls}, aliases, own=section), end="")
        return 0
    try:
        cfg = parse_offline(cls, section, aliases, argv)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2

    import importlib

    from learner.offline.datasets import DatasetError
    from learner.offline.loop import SetupError

    trainer = importlib.import_module(f"learner.offline.{run_name}")
    try:
        trainer.run(cfg)
    except (DatasetError, SetupError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    from learner.offline.config import SFTConfig

    return offline_main("launch.sft", SFTConfig, "sft", SFT_ALIASES, __doc__, "sft", argv)


if __name__ == "__main__":
    sys.exit(main())
