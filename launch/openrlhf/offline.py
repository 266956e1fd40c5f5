"""OpenRLHF's offline command lines (`train_sft`, `train_dpo`, `train_rm`), flag by flag, on launch.sft,
launch.dpo and launch.rm.

Every option of OpenRLHF 0.11.2's `openrlhf.cli.train_sft`, `train_dpo` and `train_rm` (the dotted
names: `--model.model_name_or_path`, `--data.dataset`, `--train.batch_size`, ...) and the underscore
names of earlier releases (`--pretrain`, `--dataset`, `--train_batch_size`, ...) is one of three
kinds, as in `launch.openrlhf.flags` for `train_ppo_ray`:

- mapped (`to`): it sets a key of the trainer's section (`sft:`, `dpo:`, `rm:`) with the same
  meaning, its value converted (-1 for "never" is 0, `bf16` is `bfloat16`, `cosine_with_min_lr`
  is `cosine`);
- accepted (`note`): it has no effect here and leaving it out changes nothing the run learns (a
  CUDA-only speed-up, a logger's account); a note on stderr says so;
- refused (`refuse`): it would change what is trained and there is no counterpart here; given at
  OpenRLHF's default value it changes nothing and is accepted, at any other value the run stops
  at parse time with one line naming the flag, its value and why.

`SFT_ALIASES`, `DPO_ALIASES` and `RM_ALIASES` are the tables as `common.config.apply_flags` reads
them (an `Alias` per name, bare targets meaning the trainer's own section); their `describe()` is
the OpenRLHF part of `--help`. A bare key of the section wins over an alias of the same name
(`--seed`, `--max_len`, `--beta`, `--loss` are the section's keys, with the same meaning).
"""

from __future__ import annotations

import textwrap
from typing import Any, Callable

from common.config import Alias, ConfigError, parse_bool, suggest
from launch.openrlhf.flags import Spec, choose, note, off_if_negative, param_dtype, schedule, switch, to, whole

SPEED = "speed or memory only"
NO_LOGGER = "wandb is used with --logger.wandb.project only"


def refuse(why: str, default: Any, read: Callable[[str], Any] = str) -> Spec:
    """A flag with no counterpart: accepted at OpenRLHF's `default` (read by `read`), refused otherwise."""
    return Spec((), read, why, refused=True, default=default)


def margin_key(v: str) -> str:
    return "margin" if parse_bool(v) else ""


# ---- the flags the three commands share ----------------------------------------------------------

COMMON: dict[str, Spec] = {
    # checkpoints and output
    "ckpt.output_dir": to("save_path", why="the final model (HF format)"),
    "ckpt.save_steps": to("save_every", convert=off_if_negative, why="-1: 0 (only the final model)"),
    "ckpt.save_hf": note("checkpoints hold the model as a Hugging Face folder already"),
    "ckpt.disable_ds": note("checkpoints keep the optimizer state for resume"),
    "ckpt.path": to("run_dir", why="checkpoints go to run_dir/checkpoints, metrics to run_dir"),
    "ckpt.max_num": to("keep_checkpoints", convert=int),
    "ckpt.max_mem": note("no size cap: keep_checkpoints bounds them"),
    "ckpt.load_enable": to("resume", convert=parse_bool),
    "ds.use_universal_ckpt": note("checkpoints resume with the same number of ranks"),
    # logging and evaluation
    "logger.logging_steps": to("log_every", convert=int),
    "eval.steps": to("eval_every", convert=off_if_negative, why="-1: 0 (before and after training only)"),
    "eval.dataset": to("eval_dataset"),
    "eval.split": to("eval_split"),
    "logger.wandb.key": note("log in with `wandb login` or WANDB_API_KEY"),
    "logger.wandb.org": note("wandb's default entity is used"),
    "logger.wandb.group": note("runs are not grouped"),
    "logger.wandb.project": to("wandb_project"),
    "logger.wandb.run_name": note("the run is named after run_dir"),
    "logger.tensorboard_dir": to("tensorboard", convert=lambda v: True, why="events go under run_dir"),
    # batches and the optimizer
    "train.micro_batch_size": to("micro_batch_size", convert=int, why="examples per forward on one rank"),
    "train.batch_size": to("batch_size", convert=int, why="examples (pairs) per optimizer step, all ranks"),
    "train.max_epochs": to("epochs", convert=int),
    "train.seed": to("seed", convert=int),
    "train.full_determinism_enable": note("runs are seeded (seed)"),
    "optim": to("extra.optim", convert=choose({"adam": "adam"}, "Muon is not supported (AdamW)"), why="adam only"),
    "adam.lr": to("lr", convert=float),
    "adam.betas": to("adam_betas"),
    "adam.eps": to("adam_eps", convert=float),
    "adam.weight_decay": to("weight_decay", convert=float),
    "lr_scheduler": to("lr_schedule", convert=schedule, why="cosine_with_min_lr: cosine"),
    "lr_warmup_ratio": to("warmup_ratio", convert=float),
    "min_lr_ratio": to("min_lr_ratio", convert=float),
    "max_norm": to("max_grad_norm", convert=float),
    **{f"muon.{k}": note("used with --optim muon only") for k in ("lr", "momentum", "ns_steps", "nesterov",
                                                                   "no_nesterov")},
    # DeepSpeed and the model
    "model.model_name_or_path": to("model_path"),
    "model.gradient_checkpointing_enable": to("gradient_checkpointing", convert=parse_bool),
    "model.gradient_checkpointing_reentrant": note(SPEED),
    "model.aux_loss_coef": refuse("the MoE load-balancing loss is not supported", 0.0, float),
    "ds.zero_stage": to("zero_stage", convert=int),
    "ds.param_dtype": to("dtype", convert=param_dtype, why="bf16: bfloat16 (fp16 refused)"),
    "ds.deepcompile": note(SPEED),
    "ds.zpg": note(SPEED),
    "ds.adam_offload": note(SPEED),
    "ds.attn_implementation": note("attention is PyTorch's (sdpa/eager); the values match up to rounding"),
    "ds.experts_implementation": note(SPEED),
    "ds.grad_accum_dtype": note(SPEED),
    "ds.overlap_comm": note(SPEED),
    "ds.tensor_parallel_size": note("a memory layout: ranks are data-parallel ZeRO; the gradient is the same"),
    "ds.ring_attn_size": refuse("sequence parallelism is built for the RL learner only (train_ppo_ray's "
                                "--ds.ring_attn_size: learner.sequence_parallel); the offline trainers hold "
                                "whole sequences", 1, int),
    "ds.ring_attn_head_stride": note("used with --ds.ring_attn_size only"),
    "ds.load_in_4bit": refuse("4-bit (QLoRA) base weights are not supported", False, parse_bool),
    "ds.lora.rank": to("lora_rank", convert=int),
    "ds.lora.alpha": to("lora_alpha", convert=int),
    "ds.lora.target_modules": to("lora_target_modules"),
    "ds.lora.dropout": to("lora_dropout", convert=float),
    "ds.packing_samples": to("packing", convert=parse_bool),
    "local_rank": note("ranks come from the environment"),
    "use_ms": note("models and datasets are local folders"),
    # data
    "data.dataset": to("dataset", why="several, comma-separated"),
    "data.dataset_probs": to("dataset_probs", why="mixed as datasets.interleave_datasets does"),
    "data.dataset_split": to("dataset_split"),
    "data.max_samples": to("max_samples", convert=whole, why="of each dataset, and of the mix"),
    "data.max_len": to("max_len", convert=int),
    "data.input_template": to("input_template", why="when no chat template is applied"),
    "data.apply_chat_template": to("use_chat_template", convert=parse_bool),
    "data.tokenizer_chat_template": to("chat_template"),
    "data.disable_fast_tokenizer": note("the tokenizer folder decides"),
    "data.dataloader_num_workers": note("the data is tokenized once, before training"),
}

SFT: dict[str, Spec] = {
    **COMMON,
    "ds.use_liger_kernel": note(SPEED),
    "model.pretrain_mode_enable": to("pretrain_mode", convert=parse_bool,
                                     why="continued pre-training: the input_key text, loss on every token"),
    "data.input_key": to("prompt_key"),
    "data.output_key": to("response_key"),
    "data.multiturn": to("multiturn", convert=parse_bool, why="every assistant turn of a conversation"),
}
PAIRS: dict[str, Spec] = {
    **COMMON,
    "data.prompt_key": to("prompt_key"),
    "data.chosen_key": to("chosen_key"),
    "data.rejected_key": to("rejected_key"),
}
DPO: dict[str, Spec] = {
    **PAIRS,
    "ds.use_liger_kernel": note(SPEED),
    "model.beta": to("beta", convert=float),
    "model.ipo_enable": to("loss", convert=switch("ipo", "sigmoid"), why="true: ipo"),
    "model.label_smoothing": to("label_smoothing", convert=float),
    "model.nll_loss_coef": to("nll_coef", convert=float),
    "ref.model_name_or_path": to("ref_path"),
    "ref.offload": note("use --ref_mode precompute to free the reference model"),
}
RM: dict[str, Spec] = {
    **PAIRS,
    "ds.value_head_prefix": note("the head is the architecture's own `score` layer, which the scorer reads"),
    "model.loss_type": to("loss", convert=choose({"sigmoid": "sigmoid", "logexpsigmoid": "logexpsigmoid"},
                                                 "sigmoid or logexpsigmoid")),
    "model.margin_loss_enable": to("margin_key", convert=margin_key,
                                   why="true: the rows' `margin` column is read (false: ignored)"),
    "model.compute_fp32_loss_enable": note("the loss is always computed in float32"),
}

# ---- the underscore names of earlier releases -----------------------------------------------------

LEGACY: dict[str, str] = {
    "pretrain": "model.model_name_or_path", "ref_pretrain": "ref.model_name_or_path", "save_path": "ckpt.output_dir",
    "ckpt_path": "ckpt.path", "save_steps": "ckpt.save_steps", "logging_steps": "logger.logging_steps",
    "eval_steps": "eval.steps", "eval_dataset": "eval.dataset", "eval_split": "eval.split",
    "max_ckpt_num": "ckpt.max_num", "max_ckpt_mem": "ckpt.max_mem", "load_checkpoint": "ckpt.load_enable",
    "save_hf_ckpt": "ckpt.save_hf", "disable_ds_ckpt": "ckpt.disable_ds",
    "use_ds_universal_ckpt": "ds.use_universal_ckpt",
    "micro_train_batch_size": "train.micro_batch_size", "train_batch_size": "train.batch_size",
    "max_epochs": "train.max_epochs", "full_determinism": "train.full_determinism_enable",
    "learning_rate": "adam.lr", "adam_betas": "adam.betas", "l2": "adam.weight_decay",
    "gradient_checkpointing": "model.gradient_checkpointing_enable",
    "gradient_checkpointing_use_reentrant": "model.gradient_checkpointing_reentrant",
    "aux_loss_coef": "model.aux_loss_coef", "zero_stage": "ds.zero_stage", "param_dtype": "ds.param_dtype",
    "deepcompile": "ds.deepcompile", "zpg": "ds.zpg", "adam_offload": "ds.adam_offload",
    "attn_implementation": "ds.attn_implementation", "grad_accum_dtype": "ds.grad_accum_dtype",
    "overlap_comm": "ds.overlap_comm", "ds_tensor_parallel_size": "ds.tensor_parallel_size",
    "ring_attn_size": "ds.ring_attn_size", "ring_head_stride": "ds.ring_attn_head_stride",
    "load_in_4bit": "ds.load_in_4bit", "lora_rank": "ds.lora.rank", "lora_alpha": "ds.lora.alpha",
    "target_modules": "ds.lora.target_modules", "lora_dropout": "ds.lora.dropout",
    "packing_samples": "ds.packing_samples", "use_liger_kernel": "ds.use_liger_kernel",
    "value_head_prefix": "ds.value_head_prefix", "dataset": "data.dataset", "dataset_probs": "data.dataset_probs",
    "max_samples": "data.max_samples", "max_len": "data.max_len", "input_template": "data.input_template",
    "apply_chat_template": "data.apply_chat_template", "tokenizer_chat_template": "data.tokenizer_chat_template",
    "disable_fast_tokenizer": "data.disable_fast_tokenizer", "input_key": "data.input_key",
    "output_key": "data.output_key", "prompt_key": "data.prompt_key", "chosen_key": "data.chosen_key",
    "rejected_key": "data.rejected_key", "multiturn": "data.multiturn", "pretrain_mode": "model.pretrain_mode_enable",
    "ipo": "model.ipo_enable", "nll_loss_coef": "model.nll_loss_coef", "ref_offload": "ref.offload",
    "loss": "model.loss_type", "margin_loss": "model.margin_loss_enable",
    "compute_fp32_loss": "model.compute_fp32_loss_enable", "wandb_org": "logger.wandb.org",
    "wandb_group": "logger.wandb.group", "wandb_project": "logger.wandb.project",
    "wandb_run_name": "logger.wandb.run_name", "seed": "train.seed",
}
"""Underscore name -> 0.11.2's dotted name (looked up in the command's table)."""

LEGACY_ONLY: dict[str, Spec] = {
    "bf16": to("dtype", convert=switch("bfloat16", "float32")),
    "flash_attn": note("the model's default attention implementation is used"),
    "use_wandb": note(NO_LOGGER),
    "use_tensorboard": to("tensorboard", convert=lambda v: True, why="events go under run_dir"),
    "input_key": to("prompt_key", why="the prompt column (train_dpo and train_rm of earlier releases too)"),
}


def refusal(name: str, s: Spec) -> Callable[[str], Any]:
    """The value check of a refused flag: its default passes, anything else stops the run."""
    def check(v: str) -> Any:
        try:
            at_default = s.convert(v) == s.default
        except (TypeError, ValueError):
            at_default = False
        if not at_default:
            raise ConfigError(f"--{name} {v}: {s.why} (accepted only at OpenRLHF's default {s.default!r})")
        return v
    return check


def alias(name: str, s: Spec) -> Alias:
    if s.refused:
        return Alias(("extra.refused",), refusal(name, s))
    if not s.targets:
        return Alias((), str, s.why)
    return Alias(s.targets, s.convert)


class OfflineFlags(dict):
    """`{flag: Alias}` of one command for `apply_flags`, which also writes its `--help` section."""

    def __init__(self, command: str, table: dict[str, Spec]):
        self.command = command
        self.table = table
        self.specs = {**table, **{old: table[new] for old, new in LEGACY.items() if new in table}, **LEGACY_ONLY}
        super().__init__({n: alias(n, s) for n, s in self.specs.items()})
        self.heads = {n.split(".")[0] for n in table if "." in n}

    def __contains__(self, name: object) -> bool:
        # a dotted flag under one of OpenRLHF's sections (`--data.datasett`) is this table's to
        # refuse, naming the closest flag, rather than an unknown config section
        return dict.__contains__(self, name) or (isinstance(name, str) and name.split(".")[0] in self.heads)

    def __missing__(self, name: str) -> Alias:
        raise ConfigError(f"unknown flag --{name} (OpenRLHF {self.command} has no such option)"
                          f"{suggest(name, list(self), flag=True)}")

    def describe(self) -> list[str]:
        """Every flag grouped by kind, its earlier underscore names in brackets, with its meaning here."""
        old: dict[str, list[str]] = {}
        for legacy, dotted in LEGACY.items():
            old.setdefault(dotted, []).append(legacy)
        rows: dict[str, list[str]] = {"mapped": [], "accepted": [], "refused": []}
        bracketed = {o for dotted, names in old.items() if dotted in self.table for o in names}
        for name, s in [*self.table.items(), *[(n, x) for n, x in LEGACY_ONLY.items() if n not in bracketed]]:
            flag = f"--{name}" + "".join(f" [--{o}]" for o in old.get(name, []))
            if s.refused:
                rows["refused"].append(f"  {flag}: {s.why} (accepted at its default {s.default!r})")
            elif not s.targets:
                rows["accepted"].append(f"  {flag}: {s.why}")
            else:
                keys = ", ".join(t for t in s.targets if not t.startswith("extra."))
                rows["mapped"].append(f"  {flag}" + (f" -> {keys}" if keys else "") + (f": {s.why}" if s.why else ""))
        return [f"OpenRLHF {self.command} flags (0.11.2's dotted names, earlier underscore names in brackets);",
                "flags not given keep this section's defaults.",
                "Mapped, with the same meaning:", *wrap(rows["mapped"]),
                "Accepted, no effect here (a note says so):", *wrap(rows["accepted"]),
                "Refused (the run stops at parse time, naming the flag):", *wrap(rows["refused"])]


def wrap(rows: list[str]) -> list[str]:
    return [line for row in rows for line in textwrap.wrap(row, 110, subsequent_indent=" " * 6,
                                                            break_on_hyphens=False)]


SFT_ALIASES = OfflineFlags("train_sft", SFT)
DPO_ALIASES = OfflineFlags("train_dpo", DPO)
RM_ALIASES = OfflineFlags("train_rm", RM)
