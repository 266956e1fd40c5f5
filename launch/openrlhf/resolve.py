"""OpenRLHF flags whose meaning needs the others, and the refusals: `resolve`, which
`launch.run_config.finish` calls once every flag is read (the table is `launch.openrlhf.flags`).

What lands in `Run.extra` here: a refused flag (refused unless given at OpenRLHF's default value,
where it changes nothing), `--actor.eps_clip_low_high` (two keys), the `is_correction_*` family,
a warm-up ratio (of the run's optimizer steps), a remote reward URL (a scorer kind), `--use_wandb`,
the colocation flags (`run.placement`).
Idempotent, like `finish`: every value is derived from `run.extra` and what the user set.
"""

from __future__ import annotations

import math
from typing import Any

from common.config import ConfigError, is_set, parse_bool
from launch.openrlhf.flags import UNSET, floats, spec


def same(value: Any, default: Any) -> bool:
    """Whether a flag's value (a string from the command line) is OpenRLHF's default."""
    if default is None:
        return str(value).lower() in ("none", "null", "")
    if isinstance(default, bool):
        try:
            return parse_bool(value) == default
        except ValueError:
            return False
    try:
        if isinstance(default, list):
            return floats(value) == [float(d) for d in default]
        return float(value) == float(default)
    except (TypeError, ValueError):
        return str(value) == str(default)


def refusal(name: str, value: Any) -> str:
    """The one-line message of a refused flag, or "" where its value is OpenRLHF's default (harmless)."""
    s = spec(name)
    if s is not None and s.only is not UNSET:
        return "" if same(value, s.only) else f"--{name} {value}: {s.why}"
    if s is None or not s.refused or (s.default is not UNSET and same(value, s.default)):
        return ""
    at = "" if s.default is UNSET else f" (accepted only at OpenRLHF's default, {s.default!r})"
    return f"--{name} {value}: {s.why}{at}"


def resolve(run, explicit: dict | None = None) -> None:
    """Apply the OpenRLHF flags `run.extra` holds that need the others (or refuse them).

    Idempotent, like `run_config.finish` that calls it: every value is derived from `run.extra`."""
    x, explicit = run.extra, explicit or {}
    refused = [refusal(k.split(":", 1)[1], v) for k, v in x.items() if k.startswith("refused:")]
    if any(refused):
        raise ConfigError("; ".join(m for m in refused if m))
    l, s = run.learner, run.scorer
    if "eps_clip_low_high" in x:
        low_high = x["eps_clip_low_high"]
        if len(low_high) != 2:
            raise ConfigError(f"--actor.eps_clip_low_high {low_high}: give LOW HIGH")
        l.clip_eps_low, l.clip_eps_high = low_high
    is_correction(run)
    if "max_len" in x:  # OpenRLHF's total length: the prompt gets what the completion leaves
        max_len(run.generator, x["max_len"], explicit)
    if "lr_warmup_ratio" in x and not is_set(explicit, "learner.warmup_steps"):
        l.warmup_steps = math.ceil(x["lr_warmup_ratio"] * l.total_steps * l.updates_per_step)
    remote_reward(run, explicit)
    if "," in s.reward_model:
        raise ConfigError(f"--reward_pretrain {s.reward_model}: one reward model (scorer.reward_model)")
    given = [k for k, on in (("reward_model", "reward_model" in x), ("remote", "remote_url" in x and not s.reward_fn),
                             ("reward_fn", "remote_url" in x and s.reward_fn)) if on]
    if given and not is_set(explicit, "scorer.kinds"):
        # an OpenRLHF command names its reward: the default reward function is not asked for too
        kinds = [k for k in s.kinds if k != "reward_fn" or s.reward_fn]
        s.kinds = kinds + [k for k in given if k not in kinds]
    placement(run, explicit)
    learner_knobs(run, explicit)
    if "use_wandb" in x and not l.wandb_project:
        l.wandb_project = "openrlhf_train_ppo"
    shared = [(k.split(":", 1)[1], v) for k, v in x.items() if k.startswith("shared:")]
    for name, value in shared if l.advantage_estimator == "gae" else []:  # (no critic: nothing to agree on)
        key = spec(name).shares
        if key == "warmup_steps":  # a ratio of the run's optimizer steps, as the policy's
            agree = math.ceil(value * l.total_steps * l.updates_per_step) == l.warmup_steps
        else:
            agree = value == getattr(l, key)
        if not agree:
            raise ConfigError(f"--{name} {value}: the critic trains with the policy's AdamW settings here, and "
                              f"learner.{key} is {getattr(l, key)!r}; give the policy the same value")


def remote_reward(run, explicit: dict) -> None:
    """`--reward.remote_url` (`--remote_rm_url`): a Python file defining OpenRLHF's
    `reward_func(queries, prompts, labels, **kwargs)` is the scorer's reward function; http(s) URLs
    (comma-separated, sharing each batch) are its remote reward in OpenRLHF's protocol. Either way
    the queries are decoded with the policy's tokenizer, as OpenRLHF decodes them."""
    x, s = run.extra, run.scorer
    if "remote_url" not in x:
        return
    value = str(x["remote_url"]).strip()
    urls = [u.strip() for u in value.split(",") if u.strip()]
    if len(urls) == 1 and urls[0].endswith(".py"):
        if not is_set(explicit, "scorer.reward_fn"):
            s.reward_fn = urls[0]
    elif urls and all(u.startswith(("http://", "https://")) for u in urls):
        s.remote_url = urls[0] if len(urls) == 1 else urls
        if not is_set(explicit, "scorer.remote_protocol"):
            s.remote_protocol = "openrlhf"
    else:
        raise ConfigError(f"--remote_rm_url {value}: a reward file (FILE.py defining reward_func) or http(s) URLs, "
                          "comma-separated")
    if not is_set(explicit, "scorer.tokenizer"):
        s.tokenizer = run.learner.model_path or run.generator.model


def learner_knobs(run, explicit: dict) -> None:
    """The learner knobs OpenRLHF spells with two flags: EMA (`--train.enable_ema` and its beta),
    token-budget micro-batches (`--train.dynamic_batch_enable` and the budgets), GSPO (which
    OpenRLHF runs against the rollout policy when a vLLM correction level is set), group_norm's
    epsilon (1e-9 there)."""
    x, l = run.extra, run.learner
    if x.get("enable_ema") and not is_set(explicit, "learner.ema_beta"):
        l.ema_beta = x.get("ema_beta", 0.992)
    if x.get("dynamic_batch"):
        if not is_set(explicit, "learner.max_tokens_per_micro_batch"):
            l.max_tokens_per_micro_batch = x.get("train_max_tokens", 16192)
        if not is_set(explicit, "learner.max_tokens_per_forward"):
            l.max_tokens_per_forward = x.get("rollout_max_tokens", 0)
        if not is_set(explicit, "learner.gradient_accumulation_steps"):
            l.gradient_accumulation_steps = 1  # (OpenRLHF's too: the budget decides how many micro-batches)
    if x.get("policy_loss_type") == "gspo":
        l.policy_loss, l.behav_correction = "gspo", "none"  # (OpenRLHF applies no vLLM correction to GSPO)
        if x.get("is_correction_level", "off") != "off" or x.get("is_correction_enable"):
            l.gspo_ratio = "behav"  # a correction asked for: OpenRLHF's GSPO takes the ratio to the rollout policy
    if x.get("estimator") == "group_norm" and not is_set(explicit, "learner.adv_eps"):
        l.adv_eps = 1e-9


def max_len(g, total: int, explicit: dict) -> None:
    """`--data.max_len` (prompt + completion) as generator.max_model_len and the prompt budget
    prompt_max_len = max_len - max_new_tokens, unless the user set those keys themselves. Without
    `--rollout.max_new_tokens` each sample's completion gets what its prompt leaves (generator.max_len),
    as OpenRLHF's: max_new_tokens is then only the cap, max_len - 1."""
    if not is_set(explicit, "generator.max_model_len"):
        g.max_model_len = total
    if not is_set(explicit, "generator.max_new_tokens"):
        g.max_len, g.max_new_tokens = total, max(1, total - 1)
    if g.env and not is_set(explicit, "generator.max_context_tokens"):
        g.max_context_tokens = total  # an agent's episode: every turn within max_len, as OpenRLHF's
    if not is_set(explicit, "generator.prompt_max_len"):
        if g.max_len:  # a prompt may take all but one token: its completion gets the rest
            g.prompt_max_len = total - 1
        elif total - g.max_new_tokens < 1:
            raise ConfigError(f"--data.max_len {total}: no room for a prompt beside max_new_tokens="
                              f"{g.max_new_tokens} (OpenRLHF's max_len is prompt + completion)")
        else:
            g.prompt_max_len = total - g.max_new_tokens
    if (g.max_len or g.prompt_max_len + g.max_new_tokens) > g.max_model_len:
        raise ConfigError(f"--data.max_len {total}: generator.prompt_max_len={g.prompt_max_len} + max_new_tokens="
                          f"{g.max_new_tokens} exceeds max_model_len={g.max_model_len}")


def placement(run, explicit: dict) -> None:
    """OpenRLHF's colocation flags as `run.placement` (launch/devices/plan.py), unless the user set it:
    `--train.colocate_all` (`--colocate_all_models`) colocate; `--train.colocate_actor_ref` or
    `--train.colocate_critic_reward` colocate_scorers (the critic trains inside the learner ranks,
    the reference and reward models are the scorers'), unless colocate_all is on too."""
    x = run.extra
    if is_set(explicit, "run.placement"):
        return
    if x.get("colocate_all"):
        run.run.placement = "colocate"
    elif x.get("colocate_actor_ref") or x.get("colocate_critic_reward"):
        run.run.placement = "colocate_scorers"


def is_correction(run) -> None:
    """OpenRLHF's `--algo.advantage.is_correction_*` as `learner.behav_*` (their loss.py semantics)."""
    x, l = run.extra, run.learner
    if not any(k.startswith("is_correction_") for k in x):
        return
    level, mode = legacy_correction(x) or (x.get("is_correction_level", "off"), x.get("is_correction_mode", "mask"))
    gating, threshold = x.get("is_correction_gating", "ratio"), x.get("is_correction_threshold", [0.5, 5.0])
    if level not in ("off", "token", "seq") or mode not in ("mask", "clip") or len(threshold) not in (1, 2) \
            or gating not in ("ratio", "binary_kl", "tv"):
        raise ConfigError(f"--algo.advantage.is_correction_*: level {level!r} (off|token|seq), mode {mode!r} "
                          f"(mask|clip), gating {gating!r} (ratio|binary_kl|tv), threshold {threshold} "
                          "(HIGH or LOW HIGH)")
    low, high = (0.0, threshold[0]) if len(threshold) == 1 else threshold
    if level == "off":
        l.behav_correction = "none"
    elif mode == "clip":  # the token ratio clamped to [LOW, HIGH]
        if level == "seq" or gating != "ratio":
            raise ConfigError(f"--algo.advantage.is_correction_mode clip: needs is_correction_level token and "
                              f"is_correction_gating ratio (got {level}, {gating}), as in OpenRLHF")
        l.behav_correction, l.behav_tis_low, l.behav_tis_cap = "tis", low, high
    else:  # mask: out-of-band tokens (or whole sequences) weigh 0 and still count in the token mean
        if gating != "ratio" and low > 0:
            raise ConfigError(f"--algo.advantage.is_correction_gating {gating}: takes an upper bound only "
                              f"(threshold 0 DELTA or DELTA), got LOW {low}")
        l.behav_correction, l.behav_gating = "icepop", gating
        l.behav_mask_level = "token" if level == "token" else "sequence"
        l.behav_low, l.behav_high = low, high


LEGACY_TYPES = {"tis": ("token", "clip"), "icepop": ("token", "mask"), "seq-mask-tis": ("seq", "mask")}


def legacy_correction(x: dict) -> tuple[str, str] | None:
    """0.11.0/0.11.1's `is_correction_enable` + `is_correction_type` as 0.11.2's (level, mode), which
    compute the same (their loss.py: tis clamps the token ratio to [LOW, HIGH], icepop zeroes the
    tokens outside it, seq-mask-tis zeroes the sequences whose geometric-mean ratio is outside it);
    None where neither old flag is given."""
    if "is_correction_enable" not in x and "is_correction_type" not in x:
        return None
    if "is_correction_level" in x or "is_correction_mode" in x:
        raise ConfigError("--algo.advantage.is_correction_enable/_type (0.11.0, 0.11.1) and "
                          "is_correction_level/_mode (0.11.2) name the same correction: give one spelling")
    kind = x.get("is_correction_type", "tis")
    if kind not in LEGACY_TYPES:
        raise ConfigError(f"--algo.advantage.is_correction_type {kind}: one of {', '.join(LEGACY_TYPES)}")
    return LEGACY_TYPES[kind] if x.get("is_correction_enable") else ("off", "mask")


# ---- --help ------------------------------------------------------------------------------------
