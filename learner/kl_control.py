"""The KL coefficient of each learner step: fixed (`learner.kl_coef`), or adapted after every step
towards `learner.kl_target` (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
Preferences"; OpenRLHF's AdaptiveKLController):

    kl_coef <- kl_coef * (1 + clip(KL / kl_target - 1, -0.2, 0.2) * n / kl_horizon)

with KL the step's measured KL to the reference and n the step's samples (all ranks). The KL
measured is OpenRLHF's: with kl_in="reward", each completion's mean per-token KL under pi_old,
averaged over completions (`policy/kl_to_ref_seq_mean`); with kl_in="loss", the KL loss term
(`loss/kl`). Step N runs with the coefficient the updates of steps 0..N-1 left, and a checkpoint
keeps it (`state`, in trainer_state.json), so a resumed run goes on with the same coefficient.
"""

from __future__ import annotations

from pathlib import Path

import torch

from learner.checkpoint import read_trainer_state
from learner.config import LearnerConfig
from learner.metrics import reduce_across_ranks
from learner.modeling import masked_mean

# how far one update may move the coefficient, relative to the horizon (Ziegler et al.)
MAX_PROPORTIONAL_ERROR = 0.2
STATE_KEY = "kl_coef"


class KLController:
    """The current KL coefficient (`value`) and, with a target, its update rule."""

    def __init__(self, init_coef: float, target: float | None = None, horizon: int = 10000):
        self.value = float(init_coef)
        self.target = target
        self.horizon = horizon

    @classmethod
    def for_run(cls, cfg: LearnerConfig, checkpoint: str | Path | None = None) -> KLController:
        """The controller of `cfg`, at the coefficient `checkpoint` (a step folder, if resumed) saved."""
        ctl = cls(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
        if checkpoint is not None and cfg.kl_target is not None:
            ctl.value = float(read_trainer_state(checkpoint).get(STATE_KEY, ctl.value))
        return ctl

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    def update(self, current: float, n_samples: float) -> None:
        """One step's update from its measured KL `current` over `n_samples` samples (no-op when fixed)."""
        if not self.adaptive:
            return
        error = min(max(current / self.target - 1.0, -MAX_PROPORTIONAL_ERROR), MAX_PROPORTIONAL_ERROR)
        self.value *= 1.0 + error * n_samples / self.horizon

    def step_config(self, cfg: LearnerConfig) -> LearnerConfig:
        """`cfg` with kl_coef at the current value: what one step trains with."""
        return cfg.model_copy(update={"kl_coef": self.value}) if self.adaptive else cfg

    def after_step(self, cfg: LearnerConfig, metrics: dict[str, float], world: int, device) -> dict[str, float]:
        """Update from a step's metrics (this rank's; with several ranks a collective, on every rank
        alike); returns the metric `policy/kl_coef`, the coefficient the step trained with."""
        used = self.value
        if self.adaptive:
            key = "loss/kl" if cfg.kl_in == "loss" else "policy/kl_to_ref_seq_mean"
            measured = {key: metrics.get(key, 0.0), "perf/samples": metrics["perf/samples"]}
            if world > 1:  # (perf/samples is summed over ranks, the KL averaged)
                measured = reduce_across_ranks(measured, device)
            self.update(measured[key], measured["perf/samples"])
        return {"policy/kl_coef": used}

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps (in trainer_state.json)."""
        return {STATE_KEY: self.value}


def kl_seq_mean(kl: torch.Tensor | None, mask: torch.Tensor) -> dict[str, float]:
    """`policy/kl_to_ref_seq_mean`: each completion's mean per-token KL, averaged over completions
    (B, T) -> a number; 0 without a KL (every rank logs the key: the metrics are reduced by key)."""
    if kl is None:
        return {"policy/kl_to_ref_seq_mean": 0.0}
    has = mask.any(-1)  # (B,)
    per_seq = masked_mean(kl, mask, dim=-1)  # (B,)
    return {"policy/kl_to_ref_seq_mean": float(per_seq[has].mean()) if has.any() else 0.0}
