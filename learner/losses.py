"""Loss functions: pure functions of tensors (no model, no DeepSpeed).

Three log-probs per completion token (DESIGN.md, "Staleness and off-policy correction"):
behaviour `mu` (the generator that sampled it), proximal `pi_old` (the learner's weights at the
start of the step, no grad) and current `pi`. The decoupled PPO loss is

    w = stopgrad(pi_old / mu), corrected by `behaviour_correction`
    r = pi / pi_old
    L = -w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)

`gspo_loss` is GSPO's variant: one ratio per sequence (the geometric mean of its tokens' r), no w.

Every per-token tensor is (B, T) and lives on the same frame as `mask` (B, T) bool, which marks
the completion tokens (padding and prompt are False). T is usually L - 1 of the padded sequence
(see `learner.modeling.pad_sequences`).

Normalisers: the learner splits a step into micro-batches on several ranks, but the loss must be
that of the whole mini-batch. `aggregate` therefore takes the denominators (`num_tokens`,
`num_seqs`) from the caller; left out, they are this call's own counts.
"""

from __future__ import annotations

import torch

from learner.modeling import masked_mean

# exp() of a log-ratio beyond this is treated as this: e^20 ~ 5e8 is "infinitely off-policy" already.
MAX_LOG_RATIO = 20.0

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
CORRECTIONS = ("none", "tis", "mask", "icepop")


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token values (B, T) -> a scalar.

    - `token-mean`: sum of all masked values / num_tokens (default: mask.sum()).
    - `seq-mean-token-mean`: each sequence's token mean, summed over sequences / num_seqs
      (default: sequences with at least one masked token).
    - `seq-mean-token-sum`: each sequence's token sum, summed / num_seqs (Dr. GRPO: long
      completions are not down-weighted per token).
    """
    m = mask.to(values.dtype)
    if mode == "token-mean":
        denom = m.sum().clamp_min(1.0) if num_tokens is None else num_tokens
        return (values * m).sum() / denom
    token_sum = (values * m).sum(-1)  # (B,)
    if mode == "seq-mean-token-mean":
        per_seq = token_sum / m.sum(-1).clamp_min(1.0)  # (B,)
    elif mode == "seq-mean-token-sum":
        per_seq = token_sum
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {list(AGGREGATIONS)}")
    denom = (m.sum(-1) > 0).sum().clamp_min(1).to(values.dtype) if num_seqs is None else num_seqs
    return per_seq.sum() / denom


# OpenRLHF's bounds: a KL estimate is clipped to [-10, 10], the KL-gradient IS weight to at most 10
KL_VALUE_CLIP = 10.0
KL_IS_WEIGHT_CAP = 10.0


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3",
               unbiased_gradient: bool = False, old_logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi (Schulman, "Approximating KL").

    With log r = log ref - log pi (B, T):
      k1 = -log r                 unbiased, can be negative
      k2 = (log r)^2 / 2          biased, low variance, >= 0
      k3 = (r - 1) - log r        unbiased, low variance, >= 0
    each clipped to [-10, 10] (as OpenRLHF's compute_approx_kl).

    `unbiased_gradient` (the KL as a loss term): the value stays the estimator's, but the gradient
    is that of w * (log r)^2 / 2 with w = min(pi / pi_old, 10) (no grad; `old_logprobs` = pi_old,
    None: w = 1): an importance-weighted estimate of grad KL(pi || ref), the same for k1, k2 and k3.
    """
    dtype = torch.promote_types(logprobs.dtype, torch.float32)  # (bf16 log-probs are upcast, as OpenRLHF does)
    log_r = ref_logprobs.to(dtype) - logprobs.to(dtype)  # (B, T)
    if estimator == "k1":
        value = -log_r
    elif estimator == "k2":
        value = 0.5 * log_r.square()
    elif estimator == "k3":
        # bounded before exp(): past log r = 10 the estimate is clipped anyway (and exp could overflow)
        log_r3 = log_r.clamp(-MAX_LOG_RATIO, KL_VALUE_CLIP)
        value = torch.expm1(log_r3) - log_r3
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")
    value = value.clamp(-KL_VALUE_CLIP, KL_VALUE_CLIP)
    if not unbiased_gradient:
        return value
    w = 1.0
    if old_logprobs is not None:
        w = (logprobs.to(dtype) - old_logprobs.to(dtype)).exp().clamp(max=KL_IS_WEIGHT_CAP).detach()
    surrogate = w * 0.5 * log_r.square()  # its gradient is w * (log pi - log ref) * grad log pi
    return value.detach() + surrogate - surrogate.detach()


GATINGS = ("ratio", "binary_kl", "tv")
# the gated probabilities are kept inside [1e-6, 1 - 1e-6] so that binary_kl's logs stay finite
GATE_PROB_EPS = 1e-6


def gate_statistic(prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, mask: torch.Tensor,
                   gating: str = "ratio", level: str = "token") -> torch.Tensor:
    """What the behaviour correction's band [low, high] is tested on, per token (B, T) or per
    sequence (B, 1) (level="sequence"), as OpenRLHF's `is_correction_gating`:

      ratio      w = pi_old / mu; per sequence its geometric mean exp(mean log w)
      binary_kl  p log(p / q) + (1 - p) log((1 - p) / (1 - q)), p = mu, q = pi_old of the sampled
                 token (each clamped to [1e-6, 1 - 1e-6]); per sequence its mean
      tv         |p - q|; per sequence its mean
    """
    m = mask.bool()
    if level not in ("token", "sequence"):
        raise ValueError(f"unknown correction level {level!r}; expected token or sequence")
    if gating == "ratio":
        log_w = (prox_logprobs - behav_logprobs).masked_fill(~m, 0.0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        stat = masked_mean(log_w, m, dim=-1).unsqueeze(-1) if level == "sequence" else log_w
        return stat.exp()
    if gating not in GATINGS:
        raise ValueError(f"unknown correction gating {gating!r}; expected one of {list(GATINGS)}")
    p = behav_logprobs.float().exp().clamp(GATE_PROB_EPS, 1 - GATE_PROB_EPS)  # (B, T)
    q = prox_logprobs.float().exp().clamp(GATE_PROB_EPS, 1 - GATE_PROB_EPS)
    if gating == "binary_kl":
        stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
    else:
        stat = (p - q).abs()
    return masked_mean(stat, m, dim=-1).unsqueeze(-1) if level == "sequence" else stat


@torch.no_grad()
def behaviour_correction(
    prox_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "tis",
    tis_cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
    level: str = "token",
    gating: str = "ratio",
    tis_low: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The importance weights w = pi_old / mu the policy loss multiplies by, after correction.

    Computed once per learner step (pi_old and mu do not change within it). Returns
    `weights` (B, T) (no grad, 0 off the mask), `loss_mask` (B, T) bool (the tokens the loss
    aggregates over) and metrics.

    Modes:
      none    w = 1: no behaviour correction (plain PPO against pi_old).
      tis     truncated IS: w clamped to [tis_low, tis_cap] (OpenRLHF's token `clip` mode; tis_low 0:
              capped from above only).
      mask    masked IS as rejection: a token (level="token") or a whole sequence
              (level="sequence") whose gate statistic lies outside [low, high] is dropped from the
              loss, denominators included, as though it had never been sampled; the tokens kept carry w.
      icepop  IcePop (Ring-1T): M(w) = w inside [low, high], 0 outside, by token or sequence; the
              zeroed tokens give no gradient but still count in the loss's denominators, as in the
              paper's objective (averaged over all |o_i| tokens) and OpenRLHF's `mask` mode.
    The gate statistic (`gate_statistic`) is w itself (`gating="ratio"`) or a divergence between mu
    and pi_old (`binary_kl`, `tv`: mask and icepop only).

    Metrics: `behav_prox_kl` estimates KL(mu || pi_old) with k3 over mu's samples (w - 1 - log w);
    `ess` = (sum w)^2 / (n sum w^2) of the weights applied, in (0, 1] (1: all equal), `ess_raw` the
    same for the uncorrected w; `masked_frac` the fraction of tokens zeroed or dropped;
    `capped_frac` the fraction TIS clamped.
    """
    m = mask.bool()
    mf = m.to(prox_logprobs.dtype)
    log_w = (prox_logprobs - behav_logprobs).masked_fill(~m, 0.0)  # (B, T)
    w = log_w.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp() * mf  # (B, T)
    loss_mask = m.clone()
    dropped = torch.zeros_like(m)
    capped = torch.zeros_like(m)
    if gating != "ratio" and mode not in ("mask", "icepop"):
        raise ValueError(f"correction gating {gating!r} gates a band (mask or icepop), not mode {mode!r}")
    if mode == "none":
        applied = mf.clone()
    elif mode == "tis":
        capped = m & ((w > tis_cap) | (w < tis_low))
        applied = w.clamp(tis_low, tis_cap)
    elif mode in ("mask", "icepop"):
        stat = gate_statistic(prox_logprobs, behav_logprobs, m, gating, level)  # (B, T) or (B, 1)
        keep = ((stat >= low) & (stat <= high)).expand_as(m)  # (B, T)
        dropped = m & ~keep
        applied = w * keep
        if mode == "mask":
            loss_mask = m & keep
    else:
        raise ValueError(f"unknown behaviour correction {mode!r}; expected one of {list(CORRECTIONS)}")

    n = mf.sum().clamp_min(1.0)

    def ess(x: torch.Tensor) -> float:
        s2 = (x * x * mf).sum()
        return float((x * mf).sum() ** 2 / (n * s2)) if s2 > 0 else 0.0

    metrics = {
        "behav_prox_kl": float(((w - 1 - log_w) * mf).sum() / n),
        "ess": ess(applied),
        "ess_raw": ess(w),
        "masked_frac": float(dropped.sum() / n),
        "capped_frac": float(capped.sum() / n),
        "behav_weight_mean": float((applied * mf).sum() / n),
    }
    return applied * mf, loss_mask, metrics


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip_eps_low: float,
                      clip_eps_high: float, dual_clip_c: float | None) -> tuple[torch.Tensor, ...]:
    """PPO's per-token loss max(-r A, -clip(r) A), capped at -c A where A < 0 with dual clip;
    (loss, clipped, dual_clipped), each (B, T), the last two bool on `mask`."""
    pg1 = -adv * ratio  # (B, T)
    pg2 = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    pg = torch.maximum(pg1, pg2)
    clipped = mask & (pg2 > pg1)
    dual = torch.zeros_like(mask)
    if dual_clip_c is not None:
        cap = -adv * dual_clip_c  # (B, T)
        dual = mask & (adv < 0) & (pg > cap)
        pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
    return pg, clipped, dual


def policy_loss(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip_c: float | None = None,
    agg: str = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO: L = -w * min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), r = pi / pi_old.

    logprobs (B, T) carries the gradient; prox_logprobs, advantages and weights (B, T) do not.
    `weights` are behaviour_correction's (None: 1). With `dual_clip_c` = c, tokens with A < 0 have
    their loss capped at -c A (Ye et al., dual-clip PPO), so a huge r on a bad token cannot
    dominate. Returns the aggregated loss and metrics (`clip_frac`: tokens where the clipped
    branch was taken; `dual_clip_frac`; `approx_kl`: k3 of pi_old -> pi; `ratio_mean`).
    """
    m = mask.bool()
    log_ratio = (logprobs - prox_logprobs.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # (B, T)
    ratio = log_ratio.exp()
    pg, clipped, dual = clipped_surrogate(ratio, advantages.detach(), m, clip_eps_low, clip_eps_high, dual_clip_c)
    if weights is not None:
        pg = weights.detach() * pg
    loss = aggregate(pg, m, agg, num_tokens, num_seqs)
    with torch.no_grad():
        n = m.sum().clamp_min(1)
        metrics = {
            "clip_frac": float(clipped.sum() / n),
            "dual_clip_frac": float(dual.sum() / n),
            "approx_kl": float(masked_mean(torch.expm1(-log_ratio) + log_ratio, m)),
            "ratio_mean": float(masked_mean(ratio, m)),
        }
    return loss, metrics


def gspo_loss(
    logprobs: torch.Tensor,
    base_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip_c: float | None = None,
    num_seqs: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025), as OpenRLHF 0.11.2 computes it: one ratio per sequence,
    s = exp(mean over its tokens of log pi - log base), on every token of it, in PPO's clipped (and
    dual-clipped) loss; aggregated as seq-mean-token-mean whatever the other terms use.

    `base_logprobs` is pi_old, or the behaviour mu (OpenRLHF, when an is_correction level is set);
    no behaviour weights multiply. logprobs (B, T) carries the gradient. Metrics as `policy_loss`'s,
    `ratio_mean` being the mean sequence ratio.
    """
    m = mask.bool()
    mf = m.to(logprobs.dtype)
    log_ratio = (logprobs - base_logprobs.detach()) * mf  # (B, T)
    seq_log_ratio = log_ratio.sum(-1) / mf.sum(-1).clamp_min(1.0)  # (B,)
    seq_ratio = seq_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()  # (B,)
    ratio = seq_ratio.unsqueeze(-1) * mf  # (B, T)
    pg, clipped, dual = clipped_surrogate(ratio, advantages.detach(), m, clip_eps_low, clip_eps_high, dual_clip_c)
    loss = aggregate(pg, m, "seq-mean-token-mean", num_seqs=num_seqs)
    with torch.no_grad():
        n = m.sum().clamp_min(1)
        has = m.any(-1)
        metrics = {
            "clip_frac": float(clipped.sum() / n),
            "dual_clip_frac": float(dual.sum() / n),
            "approx_kl": float(masked_mean(torch.expm1(-log_ratio) + log_ratio, m)),
            "ratio_mean": float(seq_ratio[has].mean()) if has.any() else 1.0,
        }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    agg: str = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2).

    values (B, T) carries the gradient; old_values (the critic at the start of the step) and
    returns do not. Metrics: `value_clip_frac` (the clipped branch was larger), `value_mean`.
    """
    m = mask.bool()
    old_values, returns = old_values.detach(), returns.detach()
    v_clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)  # (B, T)
    l1 = (values - returns).square()
    l2 = (v_clipped - returns).square()
    loss = aggregate(0.5 * torch.maximum(l1, l2), m, agg, num_tokens, num_seqs)
    with torch.no_grad():
        metrics = {
            "value_clip_frac": float((m & (l2 > l1)).sum() / m.sum().clamp_min(1)),
            "value_mean": float(masked_mean(values, m)),
        }
    return loss, metrics
