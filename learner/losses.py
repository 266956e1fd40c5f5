"""Loss functions: pure functions of tensors (no model, no DeepSpeed).

Three log-probs per completion token (DESIGN.md, "Staleness and off-policy correction"):
behaviour `mu` (the generator that sampled it), proximal `pi_old` (the learner's weights at the
start of the step, no grad) and current `pi`. The decoupled PPO loss is

    w = stopgrad(pi_old / mu), corrected by `behaviour_correction`
    r = pi / pi_old
    L = -w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)

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


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi (Schulman, "Approximating KL").

    With log r = log ref - log pi (B, T):
      k1 = -log r                 unbiased, can be negative
      k2 = (log r)^2 / 2          biased, low variance, >= 0
      k3 = (r - 1) - log r        unbiased, low variance, >= 0
    """
    log_r = ref_logprobs - logprobs  # (B, T)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        # clamped so that one wildly unlikely reference token cannot overflow exp()
        log_r = log_r.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")


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
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The importance weights w = pi_old / mu the policy loss multiplies by, after correction.

    Computed once per learner step (pi_old and mu do not change within it). Returns
    `weights` (B, T) (no grad, 0 off the mask), `loss_mask` (B, T) bool (the tokens the loss
    aggregates over) and metrics.

    Modes:
      none    w = 1: no behaviour correction (plain PPO against pi_old).
      tis     truncated IS: min(w, tis_cap).
      mask    masked IS as rejection: a token (level="token") or a whole sequence
              (level="sequence", judged by its geometric-mean w = exp(mean log w)) whose w lies
              outside [low, high] is dropped from the loss, denominators included, as though it
              had never been sampled; the tokens kept carry w.
      icepop  IcePop (Ring-1T): M(w) = w inside [low, high], 0 outside, token by token; the zeroed
              tokens give no gradient but still count in the token mean, as in the paper's
              objective (averaged over all |o_i| tokens).

    Metrics: `behav_prox_kl` estimates KL(mu || pi_old) with k3 over mu's samples (w - 1 - log w);
    `ess` = (sum w)^2 / (n sum w^2) of the weights applied, in (0, 1] (1: all equal), `ess_raw` the
    same for the uncorrected w; `masked_frac` the fraction of tokens zeroed or dropped;
    `capped_frac` the fraction TIS truncated.
    """
    m = mask.bool()
    mf = m.to(prox_logprobs.dtype)
    log_w = (prox_logprobs - behav_logprobs).masked_fill(~m, 0.0)  # (B, T)
    w = log_w.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp() * mf  # (B, T)
    loss_mask = m.clone()
    dropped = torch.zeros_like(m)
    capped = torch.zeros_like(m)
    if mode == "none":
        applied = mf.clone()
    elif mode == "tis":
        capped = m & (w > tis_cap)
        applied = w.clamp(max=tis_cap)
    elif mode in ("mask", "icepop"):
        if mode == "mask" and level == "sequence":
            geo = masked_mean(log_w, m, dim=-1).exp()  # (B,) geometric mean of w per sequence
            keep = ((geo >= low) & (geo <= high)).unsqueeze(-1).expand_as(m)  # (B, T)
        elif level in ("token", "sequence"):
            keep = (w >= low) & (w <= high)  # (B, T)
        else:
            raise ValueError(f"unknown mask level {level!r}; expected token or sequence")
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
    adv = advantages.detach()
    pg1 = -adv * ratio  # (B, T)
    pg2 = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    pg = torch.maximum(pg1, pg2)
    clipped = m & (pg2 > pg1)
    dual = torch.zeros_like(m)
    if dual_clip_c is not None:
        cap = -adv * dual_clip_c  # (B, T)
        dual = m & (adv < 0) & (pg > cap)
        pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
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
