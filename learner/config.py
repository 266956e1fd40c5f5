"""The learner's configuration: section `learner:` of the run config.

Light on purpose (no torch, no DeepSpeed): `python -m launch.learner --help` and the launchers
read it without loading anything heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gae", "reinforce")


@dataclass
class LearnerConfig:
    """Section `learner:` of the run config (every field can be overridden as `--learner.KEY VALUE`)."""

    # ---- model and run ------------------------------------------------------------------------
    model_path: str = ""
    """The policy: any `AutoModelForCausalLM` folder (weights, config.json, tokenizer)."""
    run_dir: str = "runs/learner"
    """Where metrics (tensorboard, metrics.jsonl) and checkpoints/step_N/ go."""
    seed: int = 0
    """Seeds torch and the order samples are split into mini-batches (step-wise, so a resumed run
    shuffles exactly as an uninterrupted one)."""
    total_steps: int = 100
    """Learner steps (= policy versions) to train; the run also ends when the buffer says done."""

    # ---- data: the buffer ---------------------------------------------------------------------
    buffer_host: str = ""
    """Buffer address; empty: the `buffer:` section's host (or 127.0.0.1)."""
    buffer_port: int = 0
    """Buffer control port; 0: the `buffer:` section's port."""
    batch_timeout_s: float = 600.0
    """How long a rank waits for its share of one step's batch before the run fails (with the
    buffer's diagnosis of why none came)."""
    wait_log_s: float = 30.0
    """While waiting for a batch, log what the buffer reports (admission, generators, scorers)
    every this many seconds."""
    temperature: float = 1.0
    """Sampling temperature the generators used: log-probs are computed as log_softmax(logits / T)
    so that pi, pi_old and the behaviour mu are comparable."""

    # ---- advantages ---------------------------------------------------------------------------
    advantage_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae", "reinforce"] = "grpo"
    """`grpo`: (r - group mean) / (group std + adv_eps); `dr_grpo`: r - group mean; `rloo`:
    leave-one-out baseline; `reinforce_pp`: REINFORCE++ (per-token KL-shaped return, whitened over
    the batch); `gae`: PPO with a critic; `reinforce`: the raw reward (no baseline)."""
    adv_eps: float = 1e-6
    """Added to the standard deviation when normalising advantages (GRPO, REINFORCE++)."""
    gamma: float = 1.0
    """Discount for GAE and REINFORCE++ returns."""
    gae_lambda: float = 1.0
    """GAE's lambda."""

    # ---- policy loss --------------------------------------------------------------------------
    clip_eps_low: float = 0.2
    """PPO clip: r is clipped to [1 - clip_eps_low, 1 + clip_eps_high]."""
    clip_eps_high: float = 0.2
    """Upper clip (DAPO's clip-higher uses 0.28)."""
    dual_clip_c: float | None = None
    """Dual-clip PPO: for A < 0 the per-token loss is capped at -c * A (c > 1); None: off."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How token losses become one number: mean over all tokens of the (global) mini-batch; mean
    over sequences of each sequence's token mean; mean over sequences of token sums (Dr. GRPO)."""
    behav_correction: Literal["none", "tis", "mask", "icepop"] = "tis"
    """Correction of w = pi_old / mu (behaviour -> proximal): `none`: w = 1; `tis`: min(w, behav_tis_cap);
    `mask`: w, and tokens (or whole sequences) outside [behav_low, behav_high] are dropped from
    the loss; `icepop`: w, zeroed on tokens outside [behav_low, behav_high] (they still count in
    the token mean)."""
    behav_tis_cap: float = 2.0
    """C of truncated importance sampling."""
    behav_low: float = 0.5
    """Lower end of the band for `mask` and `icepop`."""
    behav_high: float = 2.0
    """Upper end of the band for `mask` and `icepop` (IcePop's paper uses [0.5, 5])."""
    behav_mask_level: Literal["token", "sequence"] = "token"
    """`mask` mode: test each token's w, or the sequence's geometric-mean w."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference (needs ref_logprobs from a reference scorer); 0: off."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Schulman's estimators of KL(pi || ref) from samples of pi."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Apply the KL as a loss term (on the current pi) or fold it into the reward (on pi_old)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (the loss subtracts entropy_coef * mean entropy); 0: not computed."""

    # ---- optimisation -------------------------------------------------------------------------
    ppo_epochs: int = 1
    """Passes over each step's batch."""
    num_mini_batches: int = 1
    """Optimizer steps per epoch: the rank's share is split into this many mini-batches."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per mini-batch (DeepSpeed accumulates their gradients)."""
    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After warm-up: hold, or decay linearly / by cosine to min_lr_ratio * lr at the last optimizer step."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to lr."""
    min_lr_ratio: float = 0.0
    """Floor of the linear and cosine schedules, as a fraction of lr."""
    max_grad_norm: float = 1.0
    """Gradient clipping (global norm); 0: off."""

    # ---- DeepSpeed ----------------------------------------------------------------------------
    zero_stage: int = 2
    """ZeRO stage 0-3 (3 partitions the parameters too; gather them with learner.engine.iter_full_params)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Training precision: fp32, or bf16 weights and activations (DeepSpeed keeps fp32 master weights)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (HF gradient checkpointing) to save memory."""
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto: NCCL when CUDA is available, else gloo."""
    dist_timeout_s: float = 1800.0
    """Bound on the ranks' rendezvous and on every collective (a rank that died or never came):
    past it the learner fails with the operation named. Keep it above batch_timeout_s."""

    # ---- critic (PPO with GAE) ----------------------------------------------------------------
    critic_path: str = ""
    """Backbone of the value model (an AutoModel folder + a linear head); empty: model_path."""
    critic_lr: float = 1e-5
    """Critic learning rate (same schedule and warm-up as the policy)."""
    value_clip_eps: float = 0.2
    """Clipped value loss: the new value may move this far from the old one before the clipped
    branch takes over."""

    # ---- weight sync --------------------------------------------------------------------------
    sync_every: int = 1
    """Rank 0 publishes weights to the weight-sync service every this many steps."""
    weight_sync_host: str = "127.0.0.1"
    """Weight-sync service address."""
    weight_sync_port: int = 0
    """Weight-sync service port; 0: no publishing (e.g. a learner alone)."""
    weight_sync_timeout_s: float = 120.0
    """How long a publish may take before the run fails."""

    # ---- checkpoints and metrics --------------------------------------------------------------
    save_every: int = 0
    """Save a checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = 0
    """Checkpoints kept (oldest deleted first); 0: keep all."""
    resume: bool = False
    """Continue from the latest checkpoint in run_dir/checkpoints (same step counter)."""
    tensorboard: bool = True
    """Write tensorboard events under run_dir (metrics.jsonl is always written)."""
    wandb_project: str = ""
    """Also log to Weights & Biases under this project when wandb is installed; empty: off."""

    def validate(self) -> None:
        errs = []

        def need(ok: bool, msg: str) -> None:
            if not ok:
                errs.append(msg)

        need(bool(self.model_path), "learner.model_path is empty: set it to an AutoModelForCausalLM folder")
        need(self.total_steps >= 1, f"learner.total_steps={self.total_steps} must be >= 1")
        need(self.temperature > 0, f"learner.temperature={self.temperature} must be > 0")
        need(self.batch_timeout_s > 0, f"learner.batch_timeout_s={self.batch_timeout_s} must be > 0")
        need(self.wait_log_s > 0, f"learner.wait_log_s={self.wait_log_s} must be > 0")
        need(self.dist_timeout_s > self.batch_timeout_s,
             f"learner.dist_timeout_s={self.dist_timeout_s} must be > batch_timeout_s={self.batch_timeout_s} "
             f"(ranks wait for their batches between collectives)")
        need(0 <= self.buffer_port < 65536, f"learner.buffer_port={self.buffer_port} is not a port")
        need(self.advantage_estimator in ADVANTAGE_ESTIMATORS,
             f"learner.advantage_estimator={self.advantage_estimator!r} is not one of {list(ADVANTAGE_ESTIMATORS)}")
        need(self.adv_eps >= 0, f"learner.adv_eps={self.adv_eps} must be >= 0")
        need(0 <= self.gamma <= 1, f"learner.gamma={self.gamma} must be in [0, 1]")
        need(0 <= self.gae_lambda <= 1, f"learner.gae_lambda={self.gae_lambda} must be in [0, 1]")
        need(0 <= self.clip_eps_low < 1, f"learner.clip_eps_low={self.clip_eps_low} must be in [0, 1)")
        need(self.clip_eps_high >= 0, f"learner.clip_eps_high={self.clip_eps_high} must be >= 0")
        need(self.dual_clip_c is None or self.dual_clip_c > 1,
             f"learner.dual_clip_c={self.dual_clip_c} must be > 1 (or null to turn dual clip off)")
        need(self.behav_tis_cap > 0, f"learner.behav_tis_cap={self.behav_tis_cap} must be > 0")
        need(0 <= self.behav_low < self.behav_high,
             f"learner.behav_low={self.behav_low}, behav_high={self.behav_high}: need 0 <= low < high")
        need(self.kl_coef >= 0, f"learner.kl_coef={self.kl_coef} must be >= 0")
        need(self.entropy_coef >= 0, f"learner.entropy_coef={self.entropy_coef} must be >= 0")
        need(self.ppo_epochs >= 1, f"learner.ppo_epochs={self.ppo_epochs} must be >= 1")
        need(self.num_mini_batches >= 1, f"learner.num_mini_batches={self.num_mini_batches} must be >= 1")
        need(self.gradient_accumulation_steps >= 1,
             f"learner.gradient_accumulation_steps={self.gradient_accumulation_steps} must be >= 1")
        need(self.lr > 0, f"learner.lr={self.lr} must be > 0")
        need(self.critic_lr > 0, f"learner.critic_lr={self.critic_lr} must be > 0")
        need(self.weight_decay >= 0, f"learner.weight_decay={self.weight_decay} must be >= 0")
        need(len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas),
             f"learner.adam_betas={self.adam_betas} must be two numbers in [0, 1)")
        need(self.adam_eps > 0, f"learner.adam_eps={self.adam_eps} must be > 0")
        need(self.warmup_steps >= 0, f"learner.warmup_steps={self.warmup_steps} must be >= 0")
        need(0 <= self.min_lr_ratio <= 1, f"learner.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        need(self.max_grad_norm >= 0, f"learner.max_grad_norm={self.max_grad_norm} must be >= 0 (0: off)")
        need(self.zero_stage in (0, 1, 2, 3), f"learner.zero_stage={self.zero_stage} must be 0, 1, 2 or 3")
        need(self.value_clip_eps > 0, f"learner.value_clip_eps={self.value_clip_eps} must be > 0")
        need(self.sync_every >= 1, f"learner.sync_every={self.sync_every} must be >= 1")
        need(0 <= self.weight_sync_port < 65536, f"learner.weight_sync_port={self.weight_sync_port} is not a port")
        need(self.weight_sync_timeout_s > 0, f"learner.weight_sync_timeout_s={self.weight_sync_timeout_s} must be > 0")
        need(self.save_every >= 0, f"learner.save_every={self.save_every} must be >= 0 (0: only at the end)")
        need(self.keep_checkpoints >= 0, f"learner.keep_checkpoints={self.keep_checkpoints} must be >= 0")
        # Cross-field checks.
        if self.kl_in == "reward" and self.kl_coef > 0 and self.advantage_estimator == "reinforce":
            errs.append("learner.kl_in='reward' with advantage_estimator='reinforce': fold the KL with "
                        "'reinforce_pp' (per token) or a group estimator, or use kl_in='loss'")
        if self.critic_path and self.advantage_estimator != "gae":
            errs.append(f"learner.critic_path={self.critic_path!r} is set but advantage_estimator="
                        f"{self.advantage_estimator!r} trains no critic (use 'gae')")
        if errs:
            raise ValueError("; ".join(errs))

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps per learner step."""
        return self.ppo_epochs * self.num_mini_batches
