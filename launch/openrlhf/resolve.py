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
    if "lr_warmup_ratio" in x and not is_set(explicit, "learner.warmup_steps"):
        l.warmup_steps = math.ceil(x["lr_warmup_ratio"] * l.total_steps * l.updates_per_step)
    if "remote_url" in x:
        urls = str(x["remote_url"]).split(",")
        if len(urls) > 1 or not urls[0].startswith(("http://", "https://")):
            raise ConfigError(f"--remote_rm_url {x['remote_url']}: one http(s) URL here; a reward script is "
                              "--scorer.reward_fn FILE defining reward_fn(prompts, completions, labels)")
        s.remote_url = urls[0]
    if "," in s.reward_model:
        raise ConfigError(f"--reward_pretrain {s.reward_model}: one reward model (scorer.reward_model)")
    given = [k for k, on in (("reward_model", "reward_model" in x), ("remote", "remote_url" in x)) if on]
    if given and not is_set(explicit, "scorer.kinds"):
        # an OpenRLHF command names its reward: the default reward function is not asked for too
        kinds = [k for k in s.kinds if k != "reward_fn" or s.reward_fn]
        s.kinds = kinds + [k for k in given if k not in kinds]
    placement(run, explicit)
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
    level, mode = x.get("is_correction_level", "off"), x.get("is_correction_mode", "mask")
    gating, threshold = x.get("is_correction_gating", "ratio"), x.get("is_correction_threshold", [0.5, 5.0])
    if gating != "ratio":
        raise ConfigError(f"--algo.advantage.is_correction_gating {gating}: only the ratio pi_old / mu is gated here")
    if level not in ("off", "token", "seq") or mode not in ("mask", "clip") or len(threshold) not in (1, 2):
        raise ConfigError(f"--algo.advantage.is_correction_*: level {level!r} (off|token|seq), mode {mode!r} "
                          f"(mask|clip), threshold {threshold} (HIGH or LOW HIGH)")
    low, high = (0.0, threshold[0]) if len(threshold) == 1 else threshold
    if level == "off":
        l.behav_correction = "none"
    elif mode == "clip":
        if level == "seq" or low > 0:
            raise ConfigError(f"--algo.advantage.is_correction_mode clip: a token ratio clamped from below too "
                              f"(LOW {low} > 0) is not supported; give one HIGH threshold (truncated IS)")
        l.behav_correction, l.behav_tis_cap = "tis", high
    else:  # mask: out-of-band tokens weigh 0 and still count in the token mean (IcePop), or whole sequences
        l.behav_correction = "icepop" if level == "token" else "mask"
        l.behav_mask_level = "token" if level == "token" else "sequence"
        l.behav_low, l.behav_high = low, high


# ---- --help ------------------------------------------------------------------------------------
