"""Configuration of the offline trainers: sections `sft:`, `dpo:` and `rm:` of a config file.

Light on purpose (no torch, no DeepSpeed): `python -m launch.sft --help` prints the field docs
without loading anything heavy. The three sections share `OfflineConfig` (data, batches,
logging, saving), which takes the model, optimiser and DeepSpeed keys from `OptimConfig`, the
same declaration the RL learner uses; each trainer adds its own loss knobs.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from common.config import redefault
from learner.config import LearnerConfig, OptimConfig


class OfflineConfig(OptimConfig):
    """Fields every offline trainer has (override as `--<section>.KEY VALUE` or `--KEY VALUE`);
    the model, AdamW and DeepSpeed keys are `OptimConfig`'s, with offline defaults."""

    section: ClassVar[str] = "offline"

    # ---- output ------------------------------------------------------------------------------
    save_path: str = ""
    """Folder the trained model is written to (HF format, with the tokenizer); empty: `<run_dir>/final`."""
    run_dir: str = ""
    """Where metrics (metrics.jsonl, tensorboard) and checkpoints/step_N/ go; empty: save_path
    (one of the two must be set)."""

    # ---- data ---------------------------------------------------------------------------------
    dataset: str = ""
    """Training data: a `.jsonl` file (one JSON object per line), a `.parquet` file (needs pyarrow)
    or a folder written by `datasets.save_to_disk` (needs the `datasets` package)."""
    dataset_split: str = "train"
    """For a `save_to_disk` folder holding several splits (a DatasetDict): the split to train on."""
    eval_dataset: str = ""
    """Held-out data in the same format; empty: `eval_fraction` of `dataset` is held out."""
    eval_fraction: float = Field(0.0, ge=0, lt=1)
    """Fraction of `dataset` held out for evaluation when `eval_dataset` is empty (0: no evaluation)."""
    max_samples: int = Field(0, ge=0)
    """Use at most this many rows of `dataset` (the first ones in the file); 0: all."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages ({role, content})."""
    messages_key: str = "messages"
    """Column holding a whole conversation (a list of {role, content}); used when present in a row
    (SFT: every assistant message is trained on; pairs: see `chosen_key`)."""
    use_chat_template: bool = True
    """Render prompts and responses with the tokenizer's chat template when it has one (the response
    is then the assistant turn); without a template the texts are concatenated."""
    max_len: int = Field(512, ge=2)
    """Longest sequence (prompt + response tokens). Longer ones are truncated (and counted); one
    with no response token left is dropped (and counted)."""
    add_eos: bool = True
    """Append the tokenizer's eos token to each response (plain-text rows only: a chat template
    writes its own end-of-turn token)."""
    on_bad_row: Literal["skip", "error"] = "error"
    """A malformed row (not JSON, missing or wrongly typed keys, empty response): `error` stops with
    the file and line; `skip` leaves it out, counts it and names the first few."""

    # ---- batches and the optimiser's offline defaults ------------------------------------------
    epochs: int = Field(1, ge=1)
    """Passes over the training data."""
    batch_size: int = Field(32, ge=1)
    """Examples (pairs for DPO and RM) per optimizer step over all ranks; the last incomplete batch
    of an epoch is dropped. Must be a multiple of micro_batch_size x ranks."""
    micro_batch_size: int = Field(8, ge=1)
    """Examples per forward/backward on one rank; batch_size / (micro_batch_size x ranks) micro-
    batches are accumulated per optimizer step."""
    warmup_ratio: float = Field(0.03, ge=0, lt=1)
    """Fraction of the optimizer steps spent warming the lr up linearly from 0."""
    lr: float = redefault(OptimConfig, "lr", 1e-5)
    lr_schedule: Literal["constant", "linear", "cosine"] = redefault(OptimConfig, "lr_schedule", "cosine")
    min_lr_ratio: float = redefault(OptimConfig, "min_lr_ratio", 0.1)
    adam_betas: list[float] = redefault(OptimConfig, "adam_betas", [0.9, 0.95])
    num_threads: int = Field(0, ge=0)
    """CPU threads torch uses in each rank (torch.set_num_threads); 0: the library default. On a
    small or shared CPU, 1 is often much faster than several threads fighting for cores."""

    # ---- logging, evaluation, checkpoints -----------------------------------------------------
    log_every: int = Field(1, ge=1)
    """Log training metrics every this many optimizer steps."""
    eval_every: int = Field(0, ge=0)
    """Evaluate on the held-out data every this many optimizer steps (also before the first step
    and after the last); 0: only before and after."""
    save_every: int = Field(0, ge=0)
    """Save a resumable checkpoint (HF weights + DeepSpeed state) every this many steps; 0: none
    (the final model is always saved to save_path)."""

    @property
    def kind(self) -> str:
        return self.section

    def output_dirs(self) -> tuple[str, str]:
        """(save_path, run_dir) with the defaults filled in."""
        run_dir = self.run_dir or self.save_path
        return self.save_path or f"{run_dir}/final", run_dir

    def problems(self) -> list[str]:
        s, errs = self.kind, []
        if self.batch_size % self.micro_batch_size:
            errs.append(f"{s}.batch_size={self.batch_size} must be a positive multiple of "
                        f"micro_batch_size={self.micro_batch_size}")
        if self.eval_dataset and self.eval_fraction:
            errs.append(f"{s}.eval_dataset={self.eval_dataset!r} and {s}.eval_fraction={self.eval_fraction} "
                        f"are both set: hold out one way")
        return errs

    def missing(self) -> list[str]:
        s, errs = self.kind, []
        if not self.model_path:
            errs.append(f"{s}.model_path is empty: set it to an AutoModelForCausalLM folder (or --pretrain)")
        if not self.dataset:
            errs.append(f"{s}.dataset is empty: set it to a .jsonl/.parquet file or a save_to_disk folder")
        if not (self.save_path or self.run_dir):
            errs.append(f"{s}.save_path and {s}.run_dir are both empty: set one")
        return errs

    def learner_config(self, total_updates: int, world_size: int) -> LearnerConfig:
        """The LearnerConfig that learner.engine builds the DeepSpeed engine from (one "step" = one
        update): the shared `OptimConfig` fields as they are, the RL-only ones neutral."""
        grad_accum = self.batch_size // (self.micro_batch_size * world_size)
        return LearnerConfig(
            **self.optim_fields(), total_steps=max(1, total_updates), ppo_epochs=1, num_mini_batches=1,
            gradient_accumulation_steps=max(1, grad_accum), warmup_steps=int(self.warmup_ratio * total_updates),
            run_dir=self.output_dirs()[1])


class SFTConfig(OfflineConfig):
    """Section `sft:`: supervised fine-tuning, loss on the response tokens only."""

    section: ClassVar[str] = "sft"

    response_key: str = "response"
    """Column holding the response (a string) in prompt/response rows."""
    packing: bool = False
    """Pack each micro-batch into one row without padding (documents kept apart by restarting
    position ids, so attention never crosses them); off: pad each micro-batch to its longest."""



class DPOConfig(OfflineConfig):
    """Section `dpo:`: direct preference optimisation (DPO, IPO, conservative DPO) on chosen/rejected pairs."""

    section: ClassVar[str] = "dpo"

    chosen_key: str = "chosen"
    """Column holding the preferred response: a string, or a list of chat messages (the last
    assistant message is the response; anything before it joins the prompt)."""
    rejected_key: str = "rejected"
    """Column holding the dispreferred response, in the same form as the chosen one."""
    beta: float = Field(0.1, gt=0)
    """DPO's beta: the strength of the implicit KL to the reference (IPO: the regulariser tau)."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """`sigmoid`: DPO, -log sigmoid(beta * h); `ipo`: IPO, (h - 1 / (2 beta))^2, where h is the
    chosen-minus-rejected log-ratio difference (summed over response tokens)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Conservative DPO (cDPO): the probability that a pair's label is flipped; 0: plain DPO."""
    nll_coef: float = Field(0.0, ge=0)
    """Weight of an added NLL (SFT) term on the chosen responses (token mean); 0: off."""
    ref_path: str = ""
    """The reference model folder; empty: model_path (the starting weights)."""
    ref_mode: Literal["precompute", "on_the_fly"] = "precompute"
    """`precompute`: the reference log-probs of every pair are computed once before training and the
    reference model is freed; `on_the_fly`: it stays loaded and is run beside every micro-batch."""

    def problems(self) -> list[str]:
        errs = super().problems()
        if self.loss == "ipo" and self.label_smoothing:
            errs.append(f"dpo.label_smoothing={self.label_smoothing} applies to the sigmoid loss, not loss='ipo'")
        if self.chosen_key == self.rejected_key:
            errs.append(f"dpo.chosen_key and dpo.rejected_key are both {self.chosen_key!r}")
        return errs


class RMConfig(OfflineConfig):
    """Section `rm:`: a reward model (scalar head, Bradley-Terry loss) on chosen/rejected pairs.

    The saved folder loads with `AutoModelForSequenceClassification` (num_labels=1, pad_token_id
    set) and is scored at the last token, as the scorer's `reward_model` kind does.
    """

    section: ClassVar[str] = "rm"

    chosen_key: str = "chosen"
    """Column holding the preferred response (a string or chat messages, as for DPO)."""
    rejected_key: str = "rejected"
    """Column holding the dispreferred response."""
    margin_key: str = "margin"
    """Optional column with a per-pair margin m >= 0: the loss becomes -log sigmoid(r_c - r_r - m)."""
    add_eos: bool = False
    """Append eos to responses. Off by default: the scorer scores prompt + completion text as
    decoded (no eos), and the model should see at training what it is scored on."""
    lr: float = redefault(OptimConfig, "lr", 9e-6)

    def problems(self) -> list[str]:
        errs = super().problems()
        if self.chosen_key == self.rejected_key:
            errs.append(f"rm.chosen_key and rm.rejected_key are both {self.chosen_key!r}")
        return errs
