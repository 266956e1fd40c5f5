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

ADVANTAGE_ESTIMATORS = ("grpo", "group_norm", "dr_grpo", "rloo", "reinforce_baseline", "flash_reinforce",
                        "reinforce_pp", "gae", "reinforce")


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
    advantage_estimator: Literal["grpo", "group_norm", "dr_grpo", "rloo", "reinforce_baseline", "flash_reinforce",
                                 "reinforce_pp", "gae", "reinforce"] = "grpo"
    """`grpo` (= OpenRLHF's `group_norm`): (r - group mean) / (group std + adv_eps); `dr_grpo`: r -
    group mean; `rloo`: leave-one-out baseline; `reinforce_baseline`: r - group mean, whitened over
    the batch; `flash_reinforce`: r - the whole batch's mean reward (no groups, no whitening);
    `reinforce_pp` (OpenRLHF's `reinforce`): REINFORCE++, the per-token KL-shaped return, whitened
    over the batch; `gae`: PPO with a critic (whitened too); `reinforce`: the raw reward. With
    kl_in="reward" each token's advantage has the KL penalties from it to the end added
    (learner/advantages.py gives the order of the steps)."""
    adv_eps: float = Field(1e-6, ge=0)
    """Added to the group's standard deviation by `grpo` (OpenRLHF's group_norm uses 1e-9)."""
    adv_std_norm: bool = True
    """The batch whitening of `gae`, `reinforce_pp` and `reinforce_baseline` divides by the std
    (sqrt(max(var, 1e-8))); off: it subtracts the mean only (OpenRLHF's no_std_norm)."""
    reward_clip_range: list[float] | None = None
    """[low, high]: the baselined reward is clipped to it before it becomes per-token (OpenRLHF's
    reward clip_range, default there [-10, 10]); None: not clipped."""
    stop_properly_penalty_coef: float | None = None
    """ProRL's penalty on completions cut at the length limit (finish_reason `length`), applied to
    the reward before any baseline: in [0, 1] it scales their reward, below 0 it replaces it; None: off."""
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
    behav_tis_low: float = Field(0.0, ge=0)
    """`tis` clamps w from below to this too (OpenRLHF's token `clip` mode with LOW > 0); 0: off."""
    behav_low: float = Field(0.5, ge=0)
    """Lower end of the band for `mask` and `icepop`."""
    behav_high: float = 2.0
    """Upper end of the band for `mask` and `icepop` (IcePop's paper uses [0.5, 5])."""
    behav_mask_level: Literal["token", "sequence"] = "token"
    """`mask` and `icepop`: test each token, or the whole sequence (its geometric-mean w, or its
    mean divergence)."""
    behav_gating: Literal["ratio", "binary_kl", "tv"] = "ratio"
    """What `mask` and `icepop` test against their band: w itself, or a divergence between mu and
    pi_old of the sampled token (binary KL, or total variation |mu - pi_old|; a trust region of
    width behav_high, behav_low must be 0). OpenRLHF's is_correction_gating."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL to the reference (needs ref_logprobs from a reference scorer); 0: off."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Schulman's estimators of KL(pi || ref) from samples of pi."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Apply the KL as a loss term (on the current pi) or fold it into the reward (on pi_old)."""
    kl_target: float | None = Field(None, gt=0)
    """Adaptive KL controller (Ziegler et al.; OpenRLHF's kl.target): after every step kl_coef is
    multiplied by 1 + clip(KL / kl_target - 1, -0.2, 0.2) * samples / kl_horizon, KL being the step's
    measured KL to the reference; kl_coef is then the initial value. None: kl_coef is fixed."""
    kl_horizon: int = Field(10000, gt=0)
    """The adaptive controller's horizon, in samples."""
    kl_unbiased_gradient: bool = False
    """With kl_in="loss": keep the estimator's value but take the gradient of the importance-weighted
    k2, min(pi / pi_old, 10) * (log pi - log ref)^2 / 2 (the same for k1, k2, k3)."""
    policy_loss: Literal["ppo", "gspo"] = "ppo"
    """`ppo`: the token-level decoupled PPO loss; `gspo`: GSPO's sequence-level ratio (exp of the
    mean token log-ratio) in the clipped loss, aggregated seq-mean-token-mean (needs
    behav_correction="none")."""
    gspo_ratio: Literal["prox", "behav"] = "prox"
    """GSPO's ratio is pi over pi_old (`prox`) or over the behaviour mu (`behav`: what OpenRLHF does
    when an is_correction level is set)."""
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
    distill_coef: float = Field(0.0, ge=0)
    """On-policy distillation: each completion token's advantage gains distill_coef x (log teacher -
    log pi_old) of its sampled token, the per-token reverse KL to the teacher (needs teacher_logprobs
    from a scorer of kind `teacher`); with no reward (or beside one). 0: off."""
    distill_baseline: Literal["none", "mean"] = "none"
    """`mean`: the distillation term's mean over the step's sampled tokens (all ranks) is subtracted
    first, a constant baseline (the gradient's expectation is unchanged, its variance lower when the
    student is far from the teacher and every token's term is large and negative); `none`: as is."""
    sequence_parallel: int = Field(1, ge=1)
    """Ranks sharing each sequence (DeepSpeed-Ulysses: each runs a slice of the positions, attention
    swaps the slices for heads with an all-to-all): run.learner_ranks / sequence_parallel groups
    train data-parallel shares. Must divide run.learner_ranks and the model's attention heads.
    OpenRLHF's ring_attn_size (learner.sequence_parallel)."""

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

    # ---- EMA, critic warm-up, MoE aux loss, token-budget micro-batches (OpenRLHF's knobs) ------
    ema_beta: float = Field(0.0, ge=0, lt=1)
    """Keep an exponential moving average of the policy, ema = beta * ema + (1 - beta) * weights after
    every optimizer step (OpenRLHF's enable_ema / ema_beta, 0.992 there); checkpoints' HF model
    folders hold the EMA, weight rounds and the DeepSpeed state the trained weights. 0: off."""
    critic_warmup_steps: int = Field(0, ge=0)
    """With GAE: the first this many learner steps train the critic only; the policy stays as it is
    (its weight rounds carry it unchanged). OpenRLHF's critic.freezing_steps."""
    aux_loss_coef: float = Field(0.0, ge=0)
    """Weight of a mixture-of-experts model's router load-balancing loss (its forward's aux_loss,
    asked for with output_router_logits) in the policy loss; 0: off. A model without a router is
    refused at start. Off by default, as for RL it should be: the loss pulls the router toward an
    even load whatever the reward says, which moves the policy away from the one that sampled the
    rollouts (see docs/moe.md)."""
    routing_replay: Literal["off", "rollout"] = "off"
    """A mixture-of-experts policy: `rollout` makes the learner's forwards (pi_old and the trained
    policy alike) route every token to the experts the generator's engine routed it to (the
    rollout carries them: the generators record them), so that training and inference run the
    same experts ("R3"); the router's weights still get the gradient of the chosen experts'
    weights. `off`: the learner's router chooses, as it does today. docs/moe.md."""
    freeze_router: bool = False
    """A mixture-of-experts policy: keep the routers' weights as they are (no gradient, not in
    the optimizer); the experts and everything else train."""
    freeze_visual_encoder: bool = False
    """A vision-language policy: keep the vision tower (patch embedding, blocks, merger) as it is
    (no gradient, not in the optimizer, left out of weight rounds); the language model trains.
    OpenRLHF's --actor.freeze_visual_encoder. docs/vision.md."""
    max_tokens_per_micro_batch: int = Field(0, ge=0)
    """Cut each mini-batch into micro-batches by tokens: the fewest (at least
    gradient_accumulation_steps, the same number on every rank) whose forward holds at most this
    many positions (rows x longest row; with packing, the packed row); a longer sequence gets one of
    its own (counted in `perf/over_budget_samples`). The gradient is the count-cut one. 0: off."""
    max_tokens_per_forward: int = Field(0, ge=0)
    """The same budget for the no-grad forwards of a step (pi_old, the critic's old values, a LoRA
    reference); 0: max_tokens_per_micro_batch."""

    def problems(self) -> list[str]:
        errs = []
        if self.dist_timeout_s <= self.batch_timeout_s:
            errs.append(f"learner.dist_timeout_s={self.dist_timeout_s} must be > batch_timeout_s="
                        f"{self.batch_timeout_s} (ranks wait for their batches between collectives)")
        if self.sequence_parallel > 1 and self.aux_loss_coef:
            errs.append(f"learner.sequence_parallel={self.sequence_parallel} with aux_loss_coef={self.aux_loss_coef}: "
                        f"the router loss is not computed over sequences split across ranks; set one of them off")
        if self.sequence_parallel > 1 and self.gradient_checkpointing:
            errs.append(f"learner.sequence_parallel={self.sequence_parallel} with gradient_checkpointing: the layers "
                        "recomputed in the backward would attend without the group's all-to-all; set one of them off")
        if self.sequence_parallel > 1 and self.routing_replay != "off":
            errs.append(f"learner.sequence_parallel={self.sequence_parallel} with routing_replay="
                        f"{self.routing_replay!r}: routes are not split across ranks; set one of them off")
        if self.behav_low >= self.behav_high:
            errs.append(f"learner.behav_low={self.behav_low}, behav_high={self.behav_high}: need 0 <= low < high")
        errs += self.openrlhf_knob_problems()
        if self.critic_path and self.advantage_estimator != "gae":
            errs.append(f"learner.critic_path={self.critic_path!r} is set but advantage_estimator="
                        f"{self.advantage_estimator!r} trains no critic (use 'gae')")
        if self.critic_warmup_steps and self.advantage_estimator != "gae":
            errs.append(f"learner.critic_warmup_steps={self.critic_warmup_steps} warms up a critic, but "
                        f"advantage_estimator={self.advantage_estimator!r} trains none (use 'gae' or set it to 0)")
        if self.ema_beta and self.lora_rank:
            # EMA(B) @ EMA(A) is no average of the weights B @ A: an EMA of the factors would be another model
            errs.append(f"learner.ema_beta={self.ema_beta} with lora_rank={self.lora_rank}: the EMA of LoRA "
                        "factors is not an average of the merged weights; set ema_beta=0 or lora_rank=0")
        return errs

    def openrlhf_knob_problems(self) -> list[str]:
        """The cross-field checks of the reward shaping, KL and loss knobs."""
        errs = []
        if self.reward_clip_range is not None and (len(self.reward_clip_range) != 2
                                                   or self.reward_clip_range[0] >= self.reward_clip_range[1]):
            errs.append(f"learner.reward_clip_range={self.reward_clip_range}: need [low, high] with low < high")
        if self.stop_properly_penalty_coef is not None and self.stop_properly_penalty_coef > 1:
            errs.append(f"learner.stop_properly_penalty_coef={self.stop_properly_penalty_coef}: need a scale in "
                        "[0, 1] or a negative reward")
        if self.kl_target is not None and self.kl_coef <= 0:
            errs.append(f"learner.kl_target={self.kl_target} adapts kl_coef, which is {self.kl_coef}: "
                        "set kl_coef > 0 (the initial coefficient)")
        if self.behav_tis_low >= self.behav_tis_cap:
            errs.append(f"learner.behav_tis_low={self.behav_tis_low}, behav_tis_cap={self.behav_tis_cap}: "
                        "need low < cap")
        if self.behav_gating != "ratio" and self.behav_correction not in ("mask", "icepop"):
            errs.append(f"learner.behav_gating={self.behav_gating!r} gates a band: it needs behav_correction "
                        f"'mask' or 'icepop', not {self.behav_correction!r}")
        if self.behav_gating != "ratio" and self.behav_low != 0:
            errs.append(f"learner.behav_gating={self.behav_gating!r} takes an upper bound only (behav_high): "
                        f"set behav_low=0, not {self.behav_low}")
        if self.policy_loss == "gspo" and self.behav_correction != "none":
            errs.append(f"learner.policy_loss='gspo' applies no behaviour correction (behav_correction="
                        f"{self.behav_correction!r}): set behav_correction='none' (gspo_ratio='behav' takes the "
                        "ratio against mu)")
        if self.gspo_ratio != "prox" and self.policy_loss != "gspo":
            errs.append(f"learner.gspo_ratio={self.gspo_ratio!r} needs policy_loss='gspo'")
        return errs

    def missing(self) -> list[str]:
        return [] if self.model_path else ["learner.model_path is empty: set it to an AutoModelForCausalLM folder"]

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps per learner step."""
        return self.ppo_epochs * self.num_mini_batches
