"""Supervised fine-tuning: `python -m launch.sft [CONFIG] [--sft.KEY VALUE ...]`.

Several ranks with either launcher (DeepSpeed over NCCL on GPUs, gloo on CPU):

    deepspeed --num_gpus 2 --module launch.sft sft.yaml --sft.zero_stage 3
    torchrun --nproc_per_node 2 -m launch.sft sft.yaml

CONFIG is a YAML file whose `sft:` section fills learner.offline_config.SFTConfig; overrides are
`--sft.KEY VALUE` or `--KEY VALUE`. OpenRLHF's `train_sft` flags are accepted with the same meaning
(`--pretrain`, `--dataset`, `--input_key`, `--output_key`, `--max_len`, `--micro_train_batch_size`,
`--train_batch_size`, `--learning_rate`, `--bf16`, `--save_path`, `--save_steps`, `--logging_steps`,
`--max_epochs`, `--packing_samples`, ...). The trained model lands in save_path in HF format.

This file also holds the command line the three offline trainers share (launch.dpo, launch.rm).
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from typing import Any, Callable

# OpenRLHF flag -> (our key, value transform). Shared by sft, dpo and rm where the key exists.
def _bf16(v: str) -> str:
    return "bfloat16" if str(v).lower() in ("1", "true", "yes", "on") else "float32"


def _save_steps(v: str) -> str:
    return "0" if int(float(v)) < 0 else v  # OpenRLHF: -1 = no intermediate checkpoints


def _warn_ignored(flag: str, why: str) -> Callable[[str], None]:
    def f(_: str) -> None:
        print(f"note: --{flag} is accepted for OpenRLHF compatibility and ignored here: {why}", file=sys.stderr)
    return f


COMMON_ALIASES: dict[str, tuple[str | None, Any]] = {
    "pretrain": ("model_path", str),
    "dataset": ("dataset", str),
    "eval_dataset": ("eval_dataset", str),
    "max_samples": ("max_samples", str),
    "max_len": ("max_len", str),
    "micro_train_batch_size": ("micro_batch_size", str),
    "train_batch_size": ("batch_size", str),
    "learning_rate": ("lr", str),
    "lr_warmup_ratio": ("warmup_ratio", str),
    "l2": ("weight_decay", str),
    "adam_betas": ("adam_betas", str),
    "max_norm": ("max_grad_norm", str),
    "bf16": ("dtype", _bf16),
    "zero_stage": ("zero_stage", str),
    "gradient_checkpointing": ("gradient_checkpointing", str),
    "save_path": ("save_path", str),
    "ckpt_path": ("run_dir", str),
    "save_steps": ("save_every", _save_steps),
    "logging_steps": ("log_every", str),
    "eval_steps": ("eval_every", _save_steps),
    "max_ckpt_num": ("keep_checkpoints", str),
    "load_checkpoint": ("resume", str),
    "max_epochs": ("epochs", str),
    "seed": ("seed", str),
    "prompt_key": ("prompt_key", str),
    "input_key": ("prompt_key", str),
    "apply_chat_template": ("use_chat_template", str),
    "flash_attn": (None, _warn_ignored("flash_attn", "the model's default attention implementation is used")),
}
SFT_ALIASES = {**COMMON_ALIASES, "output_key": ("response_key", str), "packing_samples": ("packing", str)}


def parse_offline(cls: type, section: str, aliases: dict, argv: list[str]):
    """The config of one offline trainer: YAML section, then overrides (dotted, bare or OpenRLHF)."""
    from launch.config import ConfigError, load_section, parse_overrides

    config_path = argv.pop(0) if argv and not argv[0].startswith("--") else None
    fields = [f.name for f in dataclasses.fields(cls)]
    overrides: dict[str, str] = {}
    for key, value in parse_overrides(argv).items():
        bare = key[len(section) + 1:] if key.startswith(section + ".") else key
        if "." not in key and bare in aliases and bare not in fields:
            target, conv = aliases[bare]
            try:
                value = conv(value)
            except (TypeError, ValueError):
                raise ConfigError(f"--{key}: cannot use {value!r}") from None
            if target is not None:
                overrides[target] = value
            continue
        if bare not in fields:
            known = [f"{section}.{f}" for f in fields] + list(aliases)
            near = difflib.get_close_matches(bare, fields + list(aliases), n=1, cutoff=0.5)
            hint = f" (did you mean --{near[0]}?)" if near else f"; known: {', '.join(known[:8])}, ..."
            raise ConfigError(f"unknown flag --{key}{hint}")
        overrides[bare] = value
    return load_section(cls, section, config_path, overrides)


def field_docs(cls: type) -> list[tuple[str, str, str]]:
    """(name, default, docstring) of a config dataclass and its bases, read from the source (no torch)."""
    import ast
    import inspect

    out: dict[str, tuple[str, str, str]] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        tree = ast.parse(inspect.getsource(klass))
        body = tree.body[0].body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                doc = ""
                if i + 1 < len(body) and isinstance(body[i + 1], ast.Expr) and isinstance(body[i + 1].value, ast.Constant):
                    doc = " ".join(str(body[i + 1].value.value).split())
                default = ast.unparse(node.value) if node.value is not None else ""
                out[node.target.id] = (node.target.id, default, doc)
    return list(out.values())


def offline_main(prog: str, cls: type, section: str, aliases: dict, doc: str, run_name: str,
                 argv: list[str] | None) -> int:
    """Parse, then call learner.<run_name>.run; exit code 2 for a bad config or dataset."""
    from launch.config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(doc.strip() + f"\n\nKeys of the `{section}:` section (override as --{section}.KEY VALUE or --KEY VALUE):\n")
        for name, default, text in field_docs(cls):
            print(f"  {name} = {default}\n      {text}")
        print("\nOpenRLHF flags: " + ", ".join(f"--{a}" for a in aliases))
        return 0
    # the deepspeed launcher appends --local_rank=N; the rank comes from the environment anyway
    argv = [a for a in argv if not a.startswith("--local_rank")]
    try:
        cfg = parse_offline(cls, section, aliases, argv)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2

    import importlib

    from learner.datasets import DatasetError
    from learner.offline import SetupError

    trainer = importlib.import_module(f"learner.{run_name}")
    try:
        trainer.run(cfg)
    except (DatasetError, SetupError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    from learner.offline_config import SFTConfig

    return offline_main("launch.sft", SFTConfig, "sft", SFT_ALIASES, __doc__, "sft", argv)


if __name__ == "__main__":
    sys.exit(main())
