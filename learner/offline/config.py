"""Configuration of the offline trainers: sections `sft:`, `dpo:` and `rm:` of a config file.

Light on purpose (no torch, no DeepSpeed): `python -m launch.sft --help` prints the field docs
without loading anything heavy. The three sections share `OfflineConfig` (data, batches,
logging, saving), which takes the model, optimiser and DeepSpeed keys from `OptimConfig`, the
same declaration the RL learner uses; each trainer adds its own loss knobs.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from common.config import Section, redefault
from learner.config import LearnerConfig, OptimConfig


def dataset_names(dataset: str) -> list[str]:
    """The datasets of a comma-separated `dataset` key, in order."""
    return [n.strip() for n in dataset.split(",") if n.strip()]


def template_ok(template: str) -> bool:
    """Whether `template` holds exactly one `{}` and no other unescaped braces."""
    try:
        return "{}" in template and template.format("") is not None
    except (IndexError, KeyError, ValueError):
        return False


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
    or a folder written by `datasets.save_to_disk` (needs the `datasets` package); several,
    comma-separated, are mixed by `dataset_probs` (or follow one another)."""
    dataset_probs: list[float] | None = None
    """With several datasets: the share of each (e.g. `0.7,0.3`), mixed as OpenRLHF mixes them
    (`datasets.interleave_datasets`, seeded by `seed`: a dataset that runs out starts again until
    every one was used whole); None: the datasets one after the other."""
    dataset_split: str = "train"
    """For a `save_to_disk` folder holding several splits (a DatasetDict): the split to train on."""
    eval_dataset: str = ""
    """Held-out data in the same format (several, comma-separated, follow one another); empty:
    `eval_fraction` of `dataset` is held out."""
    eval_split: str = ""
    """The split of `eval_dataset` to read; empty: `dataset_split`."""
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
    chat_template: str = ""
    """A Jinja chat template that replaces the tokenizer's own (OpenRLHF's `--data.tokenizer_chat_template`);
    empty: the tokenizer's. Saved with the trained model's tokenizer."""
    input_template: str = ""
    """A template with one `{}` a string prompt is put into (e.g. `User: {}\nAssistant: `) when the
    texts are concatenated (no chat template used), as OpenRLHF's `--data.input_template`; empty: none."""
    packing: bool = False
    """Pack each micro-batch into one row without padding (documents kept apart by restarting
    position ids, so attention never crosses them); off: pad each micro-batch to its longest.
    DPO and the reward model pack a pair's chosen and rejected sequences side by side."""
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
        n_sets = len(dataset_names(self.dataset))
        if self.dataset_probs is not None and (len(self.dataset_probs) != n_sets
                                               or any(not p > 0 for p in self.dataset_probs)):
            errs.append(f"{s}.dataset_probs={self.dataset_probs} must hold one share > 0 for each of the "
                        f"{n_sets} dataset(s) in {s}.dataset={self.dataset!r}")
        if self.input_template and not template_ok(self.input_template):
            errs.append(f"{s}.input_template={self.input_template!r} must hold exactly one `{{}}` to put the "
                        f"prompt in, and no other braces unless doubled")
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
    """Column holding the response (a string) in prompt/response rows. A row without it whose
    `prompt_key` column holds a conversation ending with an assistant message is a conversation."""
    multiturn: bool = True
    """In a conversation, train on every assistant message; false: on the last one only (the
    turns before it are the prompt)."""
    pretrain_mode: bool = False
    """Continued pre-training: each row's `prompt_key` column is a plain text, encoded as a whole
    (no chat or input template) and trained on every token (no prompt masking); eos is appended
    when `add_eos`."""


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
    """Optional column with a per-pair margin m >= 0: the loss becomes -log sigmoid(r_c - r_r - m);
    empty: margins are not read."""
    loss: Literal["sigmoid", "logexpsigmoid"] = "sigmoid"
    """`sigmoid`: -log sigmoid(r_c - r_r - m) (Bradley-Terry, with the margin); `logexpsigmoid`:
    log(1 + exp(r_r - r_c)) (Anthropic's HH form; the same value without the margin, which it ignores)."""
    add_eos: bool = False
    """Append eos to responses. Off by default: the scorer scores prompt + completion text as
    decoded (no eos), and the model should see at training what it is scored on."""
    lr: float = redefault(OptimConfig, "lr", 9e-6)

    def problems(self) -> list[str]:
        errs = super().problems()
        if self.chosen_key == self.rejected_key:
            errs.append(f"rm.chosen_key and rm.rejected_key are both {self.chosen_key!r}")
        return errs


class LoraCombineConfig(Section):
    """Section `lora_combiner:`: merge a LoRA adapter folder into its base model and save the result."""

    section: ClassVar[str] = "lora_combiner"

    model_path: str = ""
    """The base model folder the adapter was trained on (a causal LM; with `is_rm`, a reward model
    or the causal LM it was trained from)."""
    lora_path: str = ""
    """The adapter folder in peft's format (adapter_config.json + adapter_model.safetensors)."""
    output_path: str = ""
    """Where the merged model is written (a Hugging Face folder, with the base's tokenizer)."""
    is_rm: bool = False
    """The model is a reward model: an AutoModelForSequenceClassification with one label (its
    `score` head comes from the adapter folder when the adapter trained it)."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """The dtype the base is loaded in, merged and saved in (OpenRLHF's `--ds.param_dtype`: bf16)."""

    def missing(self) -> list[str]:
        return [f"lora_combiner.{k} is empty: set it (--{k} DIR)"
                for k in ("model_path", "lora_path", "output_path") if not getattr(self, k)]
