"""Configuration of the offline trainers: sections `sft:`, `dpo:` and `rm:` of a config file.

Light on purpose (no torch, no DeepSpeed): `python -m launch.sft --help` reads the field docs from
this file's source without loading anything heavy. The three dataclasses share `OfflineConfig`
(model, data, optimisation, DeepSpeed, saving); each adds its own loss knobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from learner.config import LearnerConfig


@dataclass
class OfflineConfig:
    """Fields every offline trainer has (override as `--<section>.KEY VALUE` or `--KEY VALUE`)."""

    # ---- model and output ---------------------------------------------------------------------
    model_path: str = ""
    """The model to start from: an `AutoModelForCausalLM` folder (weights, config.json, tokenizer)."""
    save_path: str = ""
    """Folder the trained model is written to (HF format, with the tokenizer); empty: `<run_dir>/final`."""
    run_dir: str = ""
    """Where metrics (metrics.jsonl, tensorboard) and checkpoints/step_N/ go; empty: save_path
    (one of the two must be set)."""
    seed: int = 0
    """Seeds torch, the held-out split and the order examples are visited in (per epoch)."""

    # ---- data ---------------------------------------------------------------------------------
    dataset: str = ""
    """Training data: a `.jsonl` file (one JSON object per line), a `.parquet` file (needs pyarrow)
    or a folder written by `datasets.save_to_disk` (needs the `datasets` package)."""
    dataset_split: str = "train"
    """For a `save_to_disk` folder holding several splits (a DatasetDict): the split to train on."""
    eval_dataset: str = ""
    """Held-out data in the same format; empty: `eval_fraction` of `dataset` is held out."""
    eval_fraction: float = 0.0
    """Fraction of `dataset` held out for evaluation when `eval_dataset` is empty (0: no evaluation)."""
    max_samples: int = 0
    """Use at most this many rows of `dataset` (the first ones in the file); 0: all."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages ({role, content})."""
    messages_key: str = "messages"
    """Column holding a whole conversation (a list of {role, content}); used when present in a row
    (SFT: every assistant message is trained on; pairs: see `chosen_key`)."""
    use_chat_template: bool = True
    """Render prompts and responses with the tokenizer's chat template when it has one (the response
    is then the assistant turn); without a template the texts are concatenated."""
    max_len: int = 512
    """Longest sequence (prompt + response tokens). Longer ones are truncated (and counted); one
    with no response token left is dropped (and counted)."""
    add_eos: bool = True
    """Append the tokenizer's eos token to each response (plain-text rows only: a chat template
    writes its own end-of-turn token)."""
    on_bad_row: Literal["skip", "error"] = "error"
    """A malformed row (not JSON, missing or wrongly typed keys, empty response): `error` stops with
    the file and line; `skip` leaves it out, counts it and names the first few."""

    # ---- optimisation -------------------------------------------------------------------------
    epochs: int = 1
    """Passes over the training data."""
    batch_size: int = 32
    """Examples (pairs for DPO and RM) per optimizer step over all ranks; the last incomplete batch
    of an epoch is dropped. Must be a multiple of micro_batch_size x ranks."""
    micro_batch_size: int = 8
    """Examples per forward/backward on one rank; batch_size / (micro_batch_size x ranks) micro-
    batches are accumulated per optimizer step."""
    lr: float = 1e-5
    """Peak learning rate of AdamW."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    """After warm-up: hold, or decay linearly / by cosine to min_lr_ratio * lr at the last step."""
    warmup_ratio: float = 0.03
    """Fraction of the optimizer steps spent warming the lr up linearly from 0."""
    min_lr_ratio: float = 0.1
    """Floor of the linear and cosine schedules, as a fraction of lr."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Gradient clipping (global norm); 0: off."""

    # ---- DeepSpeed ----------------------------------------------------------------------------
    zero_stage: int = 2
    """ZeRO stage 0-3."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Training precision: fp32, or bf16 weights and activations (DeepSpeed keeps fp32 master weights)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (HF gradient checkpointing) to save memory."""
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto: NCCL when CUDA is available, else gloo."""
    num_threads: int = 0
    """CPU threads torch uses in each rank (torch.set_num_threads); 0: the library default. On a
    small or shared CPU, 1 is often much faster than several threads fighting for cores."""

    # ---- logging, evaluation, checkpoints -----------------------------------------------------
    log_every: int = 1
    """Log training metrics every this many optimizer steps."""
    eval_every: int = 0
    """Evaluate on the held-out data every this many optimizer steps (also before the first step
    and after the last); 0: only before and after."""
    save_every: int = 0
    """Save a resumable checkpoint (HF weights + DeepSpeed state) every this many steps; 0: none
    (the final model is always saved to save_path)."""
    keep_checkpoints: int = 0
    """Checkpoints kept (oldest deleted first); 0: keep all."""
    resume: bool = False
    """Continue from the latest checkpoint in run_dir/checkpoints (the steps already done are skipped)."""
    tensorboard: bool = True
    """Write tensorboard events under run_dir (metrics.jsonl is always written)."""
    wandb_project: str = ""
    """Also log to Weights & Biases under this project when wandb is installed; empty: off."""

    @property
    def kind(self) -> str:
        return "offline"

    def output_dirs(self) -> tuple[str, str]:
        """(save_path, run_dir) with the defaults filled in."""
        run_dir = self.run_dir or self.save_path
        return self.save_path or f"{run_dir}/final", run_dir

    def errors(self) -> list[str]:
        """Problems with the shared fields (each quotes the bad value); subclasses add their own."""
        s = self.kind
        errs = []

        def need(ok: bool, msg: str) -> None:
            if not ok:
                errs.append(msg)

        need(bool(self.model_path), f"{s}.model_path is empty: set it to an AutoModelForCausalLM folder (or --pretrain)")
        need(bool(self.dataset), f"{s}.dataset is empty: set it to a .jsonl/.parquet file or a save_to_disk folder")
        need(bool(self.save_path or self.run_dir), f"{s}.save_path and {s}.run_dir are both empty: set one")
        need(0 <= self.eval_fraction < 1, f"{s}.eval_fraction={self.eval_fraction} must be in [0, 1)")
        need(self.max_samples >= 0, f"{s}.max_samples={self.max_samples} must be >= 0 (0: all)")
        need(self.max_len >= 2, f"{s}.max_len={self.max_len} must be >= 2")
        need(self.on_bad_row in ("skip", "error"), f"{s}.on_bad_row={self.on_bad_row!r} must be 'skip' or 'error'")
        need(self.epochs >= 1, f"{s}.epochs={self.epochs} must be >= 1")
        need(self.micro_batch_size >= 1, f"{s}.micro_batch_size={self.micro_batch_size} must be >= 1")
        need(self.batch_size >= 1 and self.batch_size % max(1, self.micro_batch_size) == 0,
             f"{s}.batch_size={self.batch_size} must be a positive multiple of micro_batch_size={self.micro_batch_size}")
        need(self.lr > 0, f"{s}.lr={self.lr} must be > 0")
        need(0 <= self.warmup_ratio < 1, f"{s}.warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        need(0 <= self.min_lr_ratio <= 1, f"{s}.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        need(self.weight_decay >= 0, f"{s}.weight_decay={self.weight_decay} must be >= 0")
        need(len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas),
             f"{s}.adam_betas={self.adam_betas} must be two numbers in [0, 1)")
        need(self.adam_eps > 0, f"{s}.adam_eps={self.adam_eps} must be > 0")
        need(self.max_grad_norm >= 0, f"{s}.max_grad_norm={self.max_grad_norm} must be >= 0 (0: off)")
        need(self.num_threads >= 0, f"{s}.num_threads={self.num_threads} must be >= 0 (0: default)")
        need(self.zero_stage in (0, 1, 2, 3), f"{s}.zero_stage={self.zero_stage} must be 0, 1, 2 or 3")
        need(self.log_every >= 1, f"{s}.log_every={self.log_every} must be >= 1")
        need(self.eval_every >= 0, f"{s}.eval_every={self.eval_every} must be >= 0")
        need(self.save_every >= 0, f"{s}.save_every={self.save_every} must be >= 0 (0: no checkpoints)")
        need(self.keep_checkpoints >= 0, f"{s}.keep_checkpoints={self.keep_checkpoints} must be >= 0")
        if self.eval_dataset and self.eval_fraction:
            errs.append(f"{s}.eval_dataset={self.eval_dataset!r} and {s}.eval_fraction={self.eval_fraction} "
                        f"are both set: hold out one way")
        return errs

    def validate(self) -> None:
        errs = self.errors()
        if errs:
            raise ValueError("; ".join(errs))

    def learner_config(self, total_updates: int, world_size: int) -> LearnerConfig:
        """The LearnerConfig that learner.engine builds the DeepSpeed engine from (one "step" = one update)."""
        grad_accum = self.batch_size // (self.micro_batch_size * world_size)
        return LearnerConfig(
            model_path=self.model_path, seed=self.seed, total_steps=max(1, total_updates), ppo_epochs=1,
            num_mini_batches=1, gradient_accumulation_steps=max(1, grad_accum), lr=self.lr,
            weight_decay=self.weight_decay, adam_betas=list(self.adam_betas), adam_eps=self.adam_eps,
            lr_schedule=self.lr_schedule, warmup_steps=int(self.warmup_ratio * total_updates),
            min_lr_ratio=self.min_lr_ratio, max_grad_norm=self.max_grad_norm, zero_stage=self.zero_stage,
            dtype=self.dtype, gradient_checkpointing=self.gradient_checkpointing, dist_backend=self.dist_backend,
            run_dir=self.output_dirs()[1], tensorboard=self.tensorboard, wandb_project=self.wandb_project)


@dataclass
class SFTConfig(OfflineConfig):
    """Section `sft:`: supervised fine-tuning, loss on the response tokens only."""

    response_key: str = "response"
    """Column holding the response (a string) in prompt/response rows."""
    packing: bool = False
    """Pack each micro-batch into one row without padding (documents kept apart by restarting
    position ids, so attention never crosses them); off: pad each micro-batch to its longest."""

    @property
    def kind(self) -> str:
        return "sft"


@dataclass
class DPOConfig(OfflineConfig):
    """Section `dpo:`: direct preference optimisation (DPO, IPO, conservative DPO) on chosen/rejected pairs."""

    chosen_key: str = "chosen"
    """Column holding the preferred response: a string, or a list of chat messages (the last
    assistant message is the response; anything before it joins the prompt)."""
    rejected_key: str = "rejected"
    """Column holding the dispreferred response, in the same form as the chosen one."""
    beta: float = 0.1
    """DPO's beta: the strength of the implicit KL to the reference (IPO: the regulariser tau)."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """`sigmoid`: DPO, -log sigmoid(beta * h); `ipo`: IPO, (h - 1 / (2 beta))^2, where h is the
    chosen-minus-rejected log-ratio difference (summed over response tokens)."""
    label_smoothing: float = 0.0
    """Conservative DPO (cDPO): the probability that a pair's label is flipped; 0: plain DPO."""
    nll_coef: float = 0.0
    """Weight of an added NLL (SFT) term on the chosen responses (token mean); 0: off."""
    ref_path: str = ""
    """The reference model folder; empty: model_path (the starting weights)."""
    ref_mode: Literal["precompute", "on_the_fly"] = "precompute"
    """`precompute`: the reference log-probs of every pair are computed once before training and the
    reference model is freed; `on_the_fly`: it stays loaded and is run beside every micro-batch."""

    @property
    def kind(self) -> str:
        return "dpo"

    def errors(self) -> list[str]:
        errs = super().errors()
        if not self.beta > 0:
            errs.append(f"dpo.beta={self.beta} must be > 0")
        if self.loss not in ("sigmoid", "ipo"):
            errs.append(f"dpo.loss={self.loss!r} must be 'sigmoid' or 'ipo'")
        if not 0 <= self.label_smoothing < 0.5:
            errs.append(f"dpo.label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        if self.loss == "ipo" and self.label_smoothing:
            errs.append(f"dpo.label_smoothing={self.label_smoothing} applies to the sigmoid loss, not loss='ipo'")
        if self.nll_coef < 0:
            errs.append(f"dpo.nll_coef={self.nll_coef} must be >= 0")
        if self.ref_mode not in ("precompute", "on_the_fly"):
            errs.append(f"dpo.ref_mode={self.ref_mode!r} must be 'precompute' or 'on_the_fly'")
        if self.chosen_key == self.rejected_key:
            errs.append(f"dpo.chosen_key and dpo.rejected_key are both {self.chosen_key!r}")
        return errs


@dataclass
class RMConfig(OfflineConfig):
    """Section `rm:`: a reward model (scalar head, Bradley-Terry loss) on chosen/rejected pairs.

    The saved folder loads with `AutoModelForSequenceClassification` (num_labels=1, pad_token_id
    set) and is scored at the last token, as the scorer's `reward_model` kind does.
    """

    chosen_key: str = "chosen"
    """Column holding the preferred response (a string or chat messages, as for DPO)."""
    rejected_key: str = "rejected"
    """Column holding the dispreferred response."""
    margin_key: str = "margin"
    """Optional column with a per-pair margin m >= 0: the loss becomes -log sigmoid(r_c - r_r - m)."""
    add_eos: bool = False
    """Append eos to responses. Off by default: the scorer scores prompt + completion text as
    decoded (no eos), and the model should see at training what it is scored on."""
    lr: float = 9e-6
    """Peak learning rate of AdamW."""

    @property
    def kind(self) -> str:
        return "rm"

    def errors(self) -> list[str]:
        errs = super().errors()
        if self.chosen_key == self.rejected_key:
            errs.append(f"rm.chosen_key and rm.rejected_key are both {self.chosen_key!r}")
        return errs
