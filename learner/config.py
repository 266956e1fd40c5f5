"""The learner's configuration: section `learner:` of the run config, and `OptimConfig`, the
model, optimiser and DeepSpeed settings it shares with the offline trainers (learner/offline/config.py).

Light on purpose (no torch, no DeepSpeed): `python -m launch.learner --help` and the launchers
read it without loading anything heavy.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from buffer.config import BufferAddress
from common.config import Section
from weight_sync.config import WeightSyncAddress

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gae", "reinforce")


class OptimConfig(Section):
    """The model, AdamW, its schedule, DeepSpeed and logging: declared once, for the RL learner
    and the offline trainers (their YAML keys stay flat: `learner.lr`, `sft.lr`). A trainer with
    other defaults redeclares a field with `redefault`."""

    model_path: str = ""
    """The model to train: any `AutoModelForCausalLM` folder (weights, config.json, tokenizer)."""
    seed: int = 0
    """Seeds torch and the order the data is visited in (per step or epoch, so a resumed run goes
    on exactly as an uninterrupted one); offline trainers: also the held-out split."""

    # ---- AdamW and its schedule ------------------------------------------------------------------
    lr: float = Field(1e-6, gt=0)
    """Peak learning rate of AdamW."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: list[float] = Field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    adam_eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After warm-up: hold, or decay linearly / by cosine to min_lr_ratio * lr at the last optimizer step."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Floor of the linear and cosine schedules, as a fraction of lr."""
    max_grad_norm: float = Field(1.0, ge=0)
    """Gradient clipping (global norm); 0: off."""

    # ---- DeepSpeed -------------------------------------------------------------------------------
    zero_stage: int = Field(2, ge=0, le=3)
    """ZeRO stage 0-3 (3 partitions the parameters too; gather them with learner.engine.iter_full_params)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Training precision: fp32, or bf16 weights and activations (DeepSpeed keeps fp32 master weights)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (HF gradient checkpointing) to save memory."""
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto: NCCL when CUDA is available, else gloo."""

    # ---- checkpoints and metrics -----------------------------------------------------------------
    keep_checkpoints: int = Field(0, ge=0)
    """Checkpoints kept (oldest deleted first); 0: keep all."""
    resume: bool = False
    """Continue from the latest checkpoint in run_dir/checkpoints (same step counter: the steps
    already done are skipped)."""
    tensorboard: bool = True
    """Write tensorboard events under run_dir (metrics.jsonl is always written)."""
    wandb_project: str = ""
    """Also log to Weights & Biases under this project when wandb is installed; empty: off."""

    # ---- LoRA (peft) -----------------------------------------------------------------------------
    lora_rank: int = Field(0, ge=0)
    """Train LoRA adapters of this rank instead of the full weights (peft); 0: full fine-tuning."""
    lora_alpha: int = Field(16, ge=1)
    """LoRA scaling numerator: the adapter's update is scaled by lora_alpha / lora_rank."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input."""
    lora_target_modules: list[str] = Field(default_factory=lambda: ["all-linear"])
    """Module names that get adapters (e.g. `q_proj`, `v_proj`), or `all-linear` (every linear layer
    but the output head)."""
    lora_save_merged: bool = False
    """Every checkpoint also holds the merged model (base + adapter) as a plain HF folder, besides
    the adapter in peft's format (`step_N/adapter/`); off: only the run's final checkpoint (and an
    offline trainer's save_path) does."""

    @field_validator("adam_betas")
    @classmethod
    def _betas(cls, betas: list[float]) -> list[float]:
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError("must be two numbers in [0, 1)")
        return betas

    def optim_fields(self) -> dict:
        """The shared fields' values (what an offline trainer hands the engine builder)."""
        return {k: getattr(self, k) for k in OptimConfig.model_fields}


class LearnerConfig(OptimConfig, WeightSyncAddress, BufferAddress):
    """Section `learner:` of the run config (every field can be overridden as `--learner.KEY VALUE`).
    The model, optimiser and DeepSpeed keys come from `OptimConfig`; the buffer and weight-sync
    addresses from `BufferAddress` and `WeightSyncAddress`."""

    section: ClassVar[str] = "learner"

    # ---- run ------------------------------------------------------------------------------------
    run_dir: str = "runs/learner"
    """Where metrics (tensorboard, metrics.jsonl) and checkpoints/step_N/ go."""
    total_steps: int = Field(100, ge=1)
    """Learner steps (= policy versions) to train; the run also ends when the buffer says done."""

    # ---- data: the buffer ---------------------------------------------------------------------
    batch_timeout_s: float = Field(600.0, gt=0)
    """How long a rank waits for its share of one step's batch before the run fails (with the
    buffer's diagnosis of why none came)."""
    wait_log_s: float = Field(30.0, gt=0)
    """While waiting for a batch, log what the buffer reports (admission, generators, scorers)
    every this many seconds."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature the generators used: log-probs are computed as log_softmax(logits / T)
    so that pi, pi_old and the behaviour mu are comparable."""

    # ---- advantages ---------------------------------------------------------------------------
    advantage_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae", "reinforce"] = "grpo"
    """`grpo`: (r - group mean) / (group std + adv_eps); `dr_grpo`: r - group mean; `rloo`:
    leave-one-out baseline; `reinforce_pp`: REINFORCE++ (per-token KL-shaped return, whitened over
    the batch); `gae`: PPO with a critic; `reinforce`: the raw reward (no baseline)."""
    adv_eps: float = Field(1e-6, ge=0)
    """Added to the standard deviation when normalising advantages (GRPO, REINFORCE++)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount for GAE and REINFORCE++ returns."""
    gae_lambda: float = Field(1.0, ge=0, le=1)
    """GAE's lambda."""

    # ---- policy loss --------------------------------------------------------------------------
    clip_eps_low: float = Field(0.2, ge=0, lt=1)
    """PPO clip: r is clipped to [1 - clip_eps_low, 1 + clip_eps_high]."""
    clip_eps_high: float = Field(0.2, ge=0)
    """Upper clip (DAPO's clip-higher uses 0.28)."""
    dual_clip_c: float | None = Field(None, gt=1)
    """Dual-clip PPO: for A < 0 the per-token loss is capped at -c * A (c > 1); None: off."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How token losses become one number: mean over all tokens of the (global) mini-batch; mean
    over sequences of each sequence's token mean; mean over sequences of token sums (Dr. GRPO)."""
    behav_correction: Literal["none", "tis", "mask", "icepop"] = "tis"
    """Correction of w = pi_old / mu (behaviour -> proximal): `none`: w = 1; `tis`: min(w, behav_tis_cap);
    `mask`: w, and tokens (or whole sequences) outside [behav_low, behav_high] are dropped from
    the loss; `icepop`: w, zeroed on tokens outside [behav_low, behav_high] (they still count in
    the token mean)."""
    behav_tis_cap: float = Field(2.0, gt=0)
    """C of truncated importance sampling."""
    behav_low: float = Field(0.5, ge=0)
    """Lower end of the band for `mask` and `icepop`."""
    behav_high: float = 2.0
    """Upper end of the band for `mask` and `icepop` (IcePop's paper uses [0.5, 5])."""
    behav_mask_level: Literal["token", "sequence"] = "token"
    """`mask` mode: test each token's w, or the sequence's geometric-mean w."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL to the reference (needs ref_logprobs from a reference scorer); 0: off."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Schulman's estimators of KL(pi || ref) from samples of pi."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Apply the KL as a loss term (on the current pi) or fold it into the reward (on pi_old)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus weight (the loss subtracts entropy_coef * mean entropy); 0: not computed."""

    # ---- DAPO overlong filtering and packed batches ----------------------------------------------
    overlong_filter: bool = False
    """DAPO's overlong filtering: completions cut off at the length limit (finish_reason `length`)
    are masked out of the loss and its token/sequence counts (they still count in the reward
    statistics and in their group's advantages); logged as `overlong/filtered_frac`."""
    packing: bool = False
    """Run the policy's and the critic's forwards on packed rows without padding (first-fit
    decreasing into rows as long as the mini-batch's longest sequence; position ids restart per
    sequence, attention stays within it); losses and gradients equal the padded ones within float
    rounding. OpenRLHF's packing_samples. (The reference scorer always packs.)"""

    # ---- optimisation -------------------------------------------------------------------------
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each step's batch."""
    num_mini_batches: int = Field(1, ge=1)
    """Optimizer steps per epoch: the rank's share is split into this many mini-batches."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-batches per mini-batch (DeepSpeed accumulates their gradients)."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warm-up from 0 to lr."""
    dist_timeout_s: float = 1800.0
    """Bound on the ranks' rendezvous and on every collective (a rank that died or never came):
    past it the learner fails with the operation named. Keep it above batch_timeout_s."""

    # ---- critic (PPO with GAE) ----------------------------------------------------------------
    critic_path: str = ""
    """Backbone of the value model (an AutoModel folder + a linear head); empty: model_path."""
    critic_lr: float = Field(1e-5, gt=0)
    """Critic learning rate (same schedule and warm-up as the policy)."""
    value_clip_eps: float = Field(0.2, gt=0)
    """Clipped value loss: the new value may move this far from the old one before the clipped
    branch takes over."""

    # ---- weight sync --------------------------------------------------------------------------
    sync_every: int = Field(1, ge=1)
    """Rank 0 publishes weights to the weight-sync service every this many steps."""
    weight_sync_timeout_s: float = Field(120.0, gt=0)
    """How long a publish may take before the run fails."""

    # ---- evaluation during training (the eval: section; buffer/eval.py) -------------------------
    eval_every: int = Field(0, ge=0)
    """Ask the buffer for the evaluation of the policy every this many steps (and of the initial
    one) before training on; taken from `eval.every` when `eval.dataset` is set; 0: never."""
    eval_timeout_s: float = Field(600.0, gt=0)
    """How long the learner waits for one evaluation before it goes on without it (said in the log,
    counted as `eval/timeouts`)."""

    # ---- checkpoints ----------------------------------------------------------------------------
    save_every: int = Field(0, ge=0)
    """Save a checkpoint every this many steps (0: only at the end)."""

    def problems(self) -> list[str]:
        errs = []
        if self.dist_timeout_s <= self.batch_timeout_s:
            errs.append(f"learner.dist_timeout_s={self.dist_timeout_s} must be > batch_timeout_s="
                        f"{self.batch_timeout_s} (ranks wait for their batches between collectives)")
        if self.behav_low >= self.behav_high:
            errs.append(f"learner.behav_low={self.behav_low}, behav_high={self.behav_high}: need 0 <= low < high")
        if self.kl_in == "reward" and self.kl_coef > 0 and self.advantage_estimator == "reinforce":
            errs.append("learner.kl_in='reward' with advantage_estimator='reinforce': fold the KL with "
                        "'reinforce_pp' (per token) or a group estimator, or use kl_in='loss'")
        if self.critic_path and self.advantage_estimator != "gae":
            errs.append(f"learner.critic_path={self.critic_path!r} is set but advantage_estimator="
                        f"{self.advantage_estimator!r} trains no critic (use 'gae')")
        return errs

    def missing(self) -> list[str]:
        return [] if self.model_path else ["learner.model_path is empty: set it to an AutoModelForCausalLM folder"]

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps per learner step."""
        return self.ppo_epochs * self.num_mini_batches
