"""Evaluation during training, kept by the buffer beside (never inside) the training stream.

The learner, once it has published the weights of version v and before it trains step v, asks for
the evaluation of v (`EvalRequest`). The first request opens a round: every evaluation prompt
becomes a group of `eval.n_samples_per_prompt` samples, leased (ahead of training groups) only to
generators whose weights are exactly v, to be sampled at `eval.temperature`. The rollouts travel
as training rollouts do (relay, scorers, ingest); their group ids, from `EVAL_GROUP_BASE` up, route
them here instead of to the training bookkeeping, so nothing of a round is queued for a batch,
written to the state log or counted by admission control. A lease that expires (its generator
died) puts its groups back for another generator, as a training lease does. Once every group is
complete or given up, the round is summarised, its samples written to
`<eval.samples_dir>/version_<v>.jsonl`, and the next request is answered with the report.

The summary, over the prompts of the round (k = n_samples_per_prompt; a sample passes when its
reward is at least `eval.pass_threshold`: for a 0/1 reward, when it is right):

    eval/pass@1        passing samples / samples
    eval/pass@k        prompts with a passing sample among their k / prompts
    eval/reward_mean   mean reward over samples
    eval/k, eval/prompts, eval/failed_prompts (given up, or scoring failed: left out of the above),
    eval/response_tokens_mean, eval/truncated_frac, eval/seconds (from the round's opening)
    eval/<task>/pass@1, pass@k, reward_mean, prompts   the same over each task's prompts, when the
                       rows name tasks (scorer.tasks, actors/tasks.py)

A buffer restarted mid-round forgets it; the learner's next request opens it again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from buffer.config import BufferConfig, EvalConfig
from buffer.groups import RequestError
from buffer.messages import EvalReport, LeaseGrant, ScoredRollout, Wait
from buffer.prompts import Prompt, prompt_group, prompts_from_config
from buffer.rules import TASK

EVAL_GROUP_BASE = 1 << 40  # training group ids count from 0 and never get here
EVAL_LEASE_BASE = 1 << 40  # nor do training lease ids
REPORTS_KEPT = 8
RETRY_S = 0.1

log = logging.getLogger("buffer.eval")


@dataclass
class EvalGroup:
    prompt: Prompt
    group_id: int
    lease_id: int | None = None
    samples: dict[int, ScoredRollout] = field(default_factory=dict)
    failed: str = ""  # why it was given up ("" while it is not)


@dataclass
class Round:
    version: int
    groups: dict[int, EvalGroup]
    opened_at: float
    k: int  # samples per prompt
    leases: dict[int, float] = field(default_factory=dict)  # lease id -> expires at

    def open_groups(self) -> list[EvalGroup]:
        return [g for g in self.groups.values() if g.lease_id is None and not self.done_with(g)]

    def done_with(self, g: EvalGroup) -> bool:
        return bool(g.failed) or len(g.samples) == self.k

    @property
    def complete(self) -> bool:
        return all(self.done_with(g) for g in self.groups.values())

    def progress(self) -> str:
        done = sum(self.done_with(g) for g in self.groups.values())
        return f"{done}/{len(self.groups)} prompts done, {len(self.leases)} leases out"


class Evaluator:
    """The rounds of one buffer; the service routes eval leases, samples and requests here."""

    def __init__(self, cfg: EvalConfig, prompts: list[Prompt], lease_ttl_s: float):
        self.cfg = cfg
        self.prompts = prompts
        self.lease_ttl_s = lease_ttl_s
        self.round: Round | None = None
        self.reports: dict[int, dict[str, float]] = {}
        self.next_group = EVAL_GROUP_BASE
        self.next_lease = EVAL_LEASE_BASE
        self.counters = {"eval_rounds": 0, "eval_rounds_abandoned": 0, "eval_samples": 0,
                         "eval_refused_version": 0, "eval_expired_leases": 0}

    @property
    def round_k(self) -> int:
        return self.cfg.n_samples_per_prompt

    @staticmethod
    def owns_group(group_id: int) -> bool:
        return group_id >= EVAL_GROUP_BASE

    @staticmethod
    def owns_lease(lease_id: int) -> bool:
        return lease_id >= EVAL_LEASE_BASE

    # ---- the learner's request ---------------------------------------------------------------

    def request(self, version: int, now: float) -> EvalReport | Wait:
        if version in self.reports:
            return EvalReport(version, self.reports[version])
        r = self.round
        if r is None or version != r.version:  # (an older one too: a learner resumed from a checkpoint)
            if r is not None:
                self.counters["eval_rounds_abandoned"] += 1
                log.warning("evaluation of version %d abandoned (%s): version %d is asked for", r.version,
                            r.progress(), version)
            self.round = r = self._open(version, now)
        if r.complete:
            return EvalReport(version, self._close(r, now))
        return Wait(f"evaluating version {version}: {r.progress()}", RETRY_S)

    def _open(self, version: int, now: float) -> Round:
        groups = {}
        for p in self.prompts:
            groups[self.next_group] = EvalGroup(p, self.next_group)
            self.next_group += 1
        self.counters["eval_rounds"] += 1
        log.info("evaluation of version %d: %d prompts x %d samples", version, len(groups),
                 self.cfg.n_samples_per_prompt)
        return Round(version, groups, now, self.cfg.n_samples_per_prompt)

    def _close(self, r: Round, now: float) -> dict[str, float]:
        values = summarise(r, self.cfg.pass_threshold, now - r.opened_at)
        self.reports[r.version] = values
        for old in sorted(self.reports)[:-REPORTS_KEPT]:
            del self.reports[old]
        self.round = None
        log.info("evaluation of version %d: pass@1 %.3f, pass@%d %.3f, reward %.3f (%d prompts, %.1fs)",
                 r.version, values["eval/pass@1"], r.k, values["eval/pass@k"], values["eval/reward_mean"],
                 values["eval/prompts"], values["eval/seconds"])
        if self.cfg.samples_dir:
            write_samples(Path(self.cfg.samples_dir) / f"version_{r.version}.jsonl", r)
        return values

    # ---- generators ------------------------------------------------------------------------

    def lease(self, max_groups: int, version: int, now: float) -> LeaseGrant | None:
        """Evaluation groups for a generator whose weights are at `version`, or None (train instead)."""
        r = self.round
        if r is None or version != r.version:
            return None
        self.expire(now)
        todo = r.open_groups()[:max_groups]
        if not todo:
            return None
        lease_id = self.next_lease
        self.next_lease += 1
        r.leases[lease_id] = now + self.lease_ttl_s
        for g in todo:
            g.lease_id = lease_id
            g.samples.clear()
        groups = [prompt_group(g.prompt, g.group_id) for g in todo]
        return LeaseGrant(lease_id, groups, r.k, self.lease_ttl_s, r.version, temperature=self.cfg.temperature)

    def renew(self, lease_id: int, now: float) -> None:
        r = self.round
        if r is None or lease_id not in r.leases:
            raise RequestError("lease_renew.lease_id", f"evaluation lease {lease_id} is not active")
        r.leases[lease_id] = now + self.lease_ttl_s

    def expire(self, now: float) -> None:
        r = self.round
        if r is None:
            return
        for lease_id in [x for x, t in r.leases.items() if t <= now]:
            del r.leases[lease_id]
            self.counters["eval_expired_leases"] += 1
            for g in r.groups.values():
                if g.lease_id == lease_id and not r.done_with(g):
                    g.lease_id = None  # leased again to the next generator at this version

    def _group(self, lease_id: int, group_id: int) -> EvalGroup | None:
        r = self.round
        g = r.groups.get(group_id) if r is not None else None
        return g if g is not None and g.lease_id == lease_id and lease_id in r.leases else None

    def group_failed(self, lease_id: int, group_id: int, reason: str) -> bool:
        g = self._group(lease_id, group_id)
        if g is None:
            return False
        g.failed = reason or "given up"
        self._release(g)
        return True

    def add_sample(self, s: ScoredRollout, versions: tuple[int | None, int | None]) -> str:
        """One scored evaluation sample: accepted | complete | late | version | duplicate | failed."""
        ro = s.rollout
        g = self._group(ro.lease_id, ro.group_id)
        if g is None:
            return "late"
        if versions != (self.round.version, self.round.version):  # (not while the learner waits: a guard)
            self.counters["eval_refused_version"] += 1
            return "version"
        if ro.sample_index in g.samples:
            return "duplicate"
        if s.failed:
            g.failed = f"scoring failed: {s.error}"[:500]
            self._release(g)
            return "failed"
        g.samples[ro.sample_index] = s
        self.counters["eval_samples"] += 1
        if len(g.samples) < self.round.k:
            return "accepted"
        self._release(g)
        return "complete"

    def _release(self, g: EvalGroup) -> None:
        r = self.round
        lease_id, g.lease_id = g.lease_id, -1  # (-1: no longer leasable; done or given up)
        if not any(x.lease_id == lease_id for x in r.groups.values()):
            r.leases.pop(lease_id, None)

    def metrics(self) -> dict[str, float]:
        return {f"buffer/{k}": float(v) for k, v in self.counters.items()}


def eval_prompts(cfg: EvalConfig, buffer_cfg: BufferConfig) -> list[Prompt]:
    """The evaluation prompts: `eval.dataset` (its `eval.split`, at most `eval.max_samples`) read with
    the training prompts' columns and template."""
    return prompts_from_config(buffer_cfg, dataset=cfg.dataset, split=cfg.split, max_samples=cfg.max_samples)


def summarise(r: Round, threshold: float, seconds: float) -> dict[str, float]:
    scored = [g for g in r.groups.values() if not g.failed]
    samples = [s for g in scored for s in g.samples.values()]
    n = max(len(samples), 1)
    lengths = [len(s.rollout.completion_ids) for s in samples]
    by_task: dict[str, list] = {}
    for g in scored:
        task = next((s.metadata.get(TASK) for s in g.samples.values()), None)
        if isinstance(task, str):
            by_task.setdefault(task, []).append(g)
    per_task = {}
    for task, groups in sorted(by_task.items()):
        ss = [s for g in groups for s in g.samples.values()]
        per_task.update({
            f"eval/{task}/pass@1": sum(s.reward >= threshold for s in ss) / max(len(ss), 1),
            f"eval/{task}/pass@k": sum(any(s.reward >= threshold for s in g.samples.values()) for g in groups)
            / len(groups),
            f"eval/{task}/reward_mean": sum(s.reward for s in ss) / max(len(ss), 1),
            f"eval/{task}/prompts": float(len(groups))})
    return per_task | {
        "eval/pass@1": sum(s.reward >= threshold for s in samples) / n,
        "eval/pass@k": (sum(any(s.reward >= threshold for s in g.samples.values()) for g in scored)
                        / max(len(scored), 1)),
        "eval/reward_mean": sum(s.reward for s in samples) / n,
        "eval/k": float(r.k),
        "eval/prompts": float(len(scored)),
        "eval/failed_prompts": float(len(r.groups) - len(scored)),
        "eval/response_tokens_mean": sum(lengths) / n,
        "eval/truncated_frac": sum(s.rollout.finish_reason == "length" for s in samples) / n,
        "eval/seconds": seconds,
    }


def write_samples(path: Path, r: Round) -> None:
    """One JSON line per sample (prompt row, sample, completion, reward), the round's file replaced whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for g in sorted(r.groups.values(), key=lambda g: g.prompt.index):
            if g.failed:
                f.write(json.dumps({"index": g.prompt.index, "prompt": g.prompt.text, "failed": g.failed}) + "\n")
            for i in sorted(g.samples):
                s = g.samples[i]
                f.write(json.dumps({"index": g.prompt.index, "sample": i, "prompt": g.prompt.text,
                                    "label": g.prompt.label, "completion": s.rollout.completion,
                                    "reward": s.reward, "finish_reason": s.rollout.finish_reason,
                                    "version": r.version}) + "\n")
    tmp.replace(path)
