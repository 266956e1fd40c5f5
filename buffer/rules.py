"""The replay buffer's rules, as plain functions: admission control, the stale-drop rule, DAPO's
dynamic-sampling rule, how a step's batch is split between learner ranks, a share's statistics,
and the diagnosis a waiting learner is given. `tests/buffer/test_state.py` and
`tests/buffer/test_dynamic_sampling.py` check them against values worked out by hand; `buffer/state.py`
applies them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from buffer.groups import ReadyGroup


def admission_limit(version: int, max_staleness: int, prompts_per_step: int) -> int:
    """Prompt groups that may be live (issued and not dropped) while the learner is at `version`.

    Steps `version .. version + max_staleness` are the ones a group leased now can end up in
    without being too old, and each takes `prompts_per_step` groups.
    """
    return (version + max_staleness + 1) * prompts_per_step


def admits(k_live: int, version: int, max_staleness: int, prompts_per_step: int) -> bool:
    """May one more new group be leased? `k_live` = groups issued so far minus groups dropped."""
    return k_live < admission_limit(version, max_staleness, prompts_per_step)


def is_stale(min_version: int, step: int, max_staleness: int) -> bool:
    """A group whose oldest token came from `min_version` may not train step `step`."""
    return min_version < step - max_staleness


REWARD_TOL = 1e-6  # rewards this close (relative to their size, at least 1) count as equal

# Names in `ScoredRollout.metadata` a scorer fills from OpenRLHF-style reward answers:
FILTER_SCORE = "filter_score"  # what dynamic sampling judges instead of the sample's reward (OpenRLHF's `scores`)
EXTRA_LOG_PREFIX = "extra/"  # + name: a number the learner logs as its per-step mean (OpenRLHF's `extra_logs`)
TASK = "task"  # the task the sample's prompt row named (actors/tasks.py): metrics per task


def filter_score(metadata: dict) -> float | None:
    """A sample's FILTER_SCORE when its scorer gave a finite number, else None (the reward is judged)."""
    x = metadata.get(FILTER_SCORE)
    if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
        return float(x)
    return None


def no_signal(rewards: list[float], reward_range: list[float] | None = None) -> bool:
    """A group whose rewards teach nothing: all equal (every group-relative advantage is 0) or, with
    `reward_range` [low, high], a mean reward not strictly inside (low, high) (OpenRLHF's rule). The
    buffer passes each sample's filter score where its scorer gave one (`Sample.judged`)."""
    lo, hi = min(rewards), max(rewards)
    if hi - lo <= REWARD_TOL * max(1.0, abs(lo), abs(hi)):
        return True
    if reward_range is not None:
        mean = sum(rewards) / len(rewards)
        return not reward_range[0] < mean < reward_range[1]
    return False


def filter_verdict(rewards: list[float], reward_range: list[float] | None, filtered_now: int, cap: int) -> str:
    """What dynamic sampling does with a complete group, `cap` groups allowed per learner version of
    which `filtered_now` are used (cap 0: it is off): keep (the rewards differ), filter, or, for a
    group with no signal, `off` or `capped` (kept: the budget of this version is spent)."""
    if not no_signal(rewards, reward_range):
        return "keep"
    if not cap:
        return "off"
    return "filter" if filtered_now < cap else "capped"


def cap_message(filtered: int, version: int, max_rounds: int, prompts_per_step: int) -> str:
    """The warning said once per version at which dynamic sampling's cap is reached."""
    return (f"dynamic sampling: {filtered} groups with no reward signal filtered at version {version}, the cap "
            f"(buffer.dynamic_filtering_max_rounds={max_rounds} x prompts_per_step={prompts_per_step}); groups "
            f"pass unfiltered until the learner's version moves. The policy solves (or fails) nearly every "
            f"prompt: raise buffer.dynamic_filtering_max_rounds, or change the prompts")


def share_bounds(n_groups: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank `rank`'s whole groups in a step's batch of `n_groups` (divisible by world_size)."""
    per = n_groups // world_size
    return rank * per, (rank + 1) * per


def share_stats(groups: list[ReadyGroup], step: int) -> dict[str, float]:
    """Staleness (versions behind `step`, per rollout) and reward of one rank's share."""
    samples = [s for g in groups for s in g.samples]
    stale = [step - s.min_version for s in samples]
    n = max(len(samples), 1)
    return {
        "staleness_min": float(min(stale, default=0)),
        "staleness_mean": sum(stale) / n,
        "staleness_max": float(max(stale, default=0)),
        "reward_mean": sum(s.reward for s in samples) / n,
        "groups": float(len(groups)),
        "rollouts": float(len(samples)),
    }


QUIET_S = 30.0  # a producer silent this long is named in a diagnosis


def describe_wait(m: dict[str, float]) -> str:
    """Why no batch is ready, from the buffer's metrics: what a waiting learner and a stall report say."""
    if m.get("buffer/awaiting_resume"):
        return ("the buffer was restored from disk and waits for the learner to say which checkpoint it "
                "resumed from")
    parts = []
    live, limit, version = m["buffer/live_groups"], m["buffer/admission_limit"], m["buffer/version"]
    if m["buffer/issued_groups"] >= m["buffer/total_groups"] and not m["buffer/requeued_groups"]:
        parts.append(f"every one of the {m['buffer/total_groups']:.0f} groups of the data has been issued")
    elif live >= limit:
        parts.append(f"admission limit reached at version {version:.0f} ({live:.0f} live groups, limit {limit:.0f})")
    filtered = m.get("buffer/filtered_this_version", 0.0)
    if filtered:
        cap = m.get("buffer/filter_cap", 0.0)
        parts.append(f"dynamic sampling filtered {filtered:.0f} groups with no reward signal at version "
                     f"{version:.0f} and leases replacements ({m.get('buffer/filter_pass_rate', 1.0):.0%} of "
                     f"groups pass; at most {cap:.0f} are filtered per step, buffer.dynamic_filtering_max_rounds)")
    since = m.get("buffer/since_lease_request_s", -1.0)
    if since < 0:
        parts.append("no generator has asked for a lease yet")
    elif since > QUIET_S:
        parts.append(f"no generator has asked for a lease for {since:.0f}s")
    if m.get("buffer/refused_old_weights_recent"):
        parts.append("a generator with weights older than max_staleness allows was refused a lease (it must "
                     "load the learner's weights first)")
    parts.append(f"groups: {m['buffer/queued_groups']:.0f} queued of {m['buffer/prompts_per_step']:.0f} per "
                 f"step, {m['buffer/leased_groups']:.0f} leased ({m['buffer/partial_groups']:.0f} partly "
                 f"scored), {m['buffer/requeued_groups']:.0f} to issue again")
    quiet = m.get("buffer/quietest_lease_s", -1.0)
    if quiet > 0.5 * m.get("buffer/lease_ttl_s", 60.0):  # generators renew every third of the ttl
        parts.append(f"a lease has not been renewed for {quiet:.0f}s (its generator may be stuck; it expires "
                     f"after buffer.lease_ttl_s)")
    scored = m.get("buffer/since_scored_s", -1.0)
    if m["buffer/leased_groups"] and (scored < 0 or scored > QUIET_S):
        parts.append("no scored rollout has arrived yet" if scored < 0 else
                     f"no scored rollout for {scored:.0f}s (are the scorers up?)")
    return "; ".join(parts)
