"""The scorer: pull raw rollouts from the buffer's relay, score them, push them back scored.

`Scorer.score` does the work for one message of rollouts: every configured reward component scores
every rollout (`scores[name]`), `reward` is their weighted sum, and a reference model adds
`ref_logprobs`, and a teacher model (on-policy distillation) `teacher_logprobs`, computed the same
way. With `scorer.overlong_buffer_len` > 0, DAPO's soft overlong punishment is one more
component, `scores["overlong"]` (weight 1). A sample any component failed on is sent with
`failed=True` and the reasons in `error`: the buffer drops its group and counts it, so a bad reward
function never stalls a run. The reward function runs in a worker process (actors/reward_files.py): one
that hangs past `scorer.reward_fn_timeout_s` or crashes fails its message's samples and is restarted.
A reward function or remote reward answering as OpenRLHF's do may add `scores` and `extra_logs`:
they travel in `ScoredRollout.metadata`, the scores (summed over the components that give them) as
`filter_score`, which the buffer's dynamic filtering judges instead of the reward, and each extra log
as `extra/<name>`, which the learner logs as the per-step mean `reward/extra/<name>` (buffer/rules.py
names both). Metadata, not `scores`: those are the reward's components, and the reward is their sum.
Several scorer processes may run side by side; the relay deals each message to one of them, and
every one runs the same components, so each sample's reward holds each component (overlong too) once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from actors.config import ScorerConfig
from actors.judge import DEFAULT_TEMPLATE, JudgeReward
from actors.reward_files import RewardFn
from actors.rewards import EnvReward, OverlongPenalty, RemoteReward, RewardModel, Score
from actors.tasks import TaskRewards, task_of
from buffer.client import BufferClient
from buffer.messages import LOGPROB_DTYPE, ProtocolError, Rollout, ScoredRollout
from buffer.rules import EXTRA_LOG_PREFIX, FILTER_SCORE, TASK
from common.guards import WarnLimiter
from common.ready import mark_ready

log = logging.getLogger("conveyor.scorer")


class Reference:
    """The frozen reference policy: log-probs of each completion token at temperature 1, computed
    with the learner's own function (`completion_logprobs`) so the KL term compares like with like.

    A vision-language reference (Qwen2-VL family) runs each rollout with its images
    (`Rollout.images`, through the model's own image processor: `learner.vision.Pixels`), as the
    learner does; a text reference refuses rollouts with images (their samples fail)."""

    name = "reference"

    def __init__(self, path: str, dtype: str = "float32", device: str = "cpu", batch_size: int = 16):
        from transformers import AutoTokenizer

        from learner.modeling import load_causal_lm
        from learner.vision import Pixels, is_vision_model

        self.path = path
        self.model = load_causal_lm(path, dtype=dtype, device=device)
        pad = AutoTokenizer.from_pretrained(path).pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.batch_size = batch_size
        self.pixels = Pixels(path) if is_vision_model(path) else None

    def logprobs(self, rollouts: Sequence[Rollout]) -> list[np.ndarray]:
        from learner.modeling import completion_logprobs

        images = [r.images for r in rollouts]
        if self.pixels is None and any(images):
            raise ValueError(f"{self.path} is a text model: it cannot score rollouts of prompts with images")
        lps = completion_logprobs(self.model, [r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts],
                                  temperature=1.0, batch_size=self.batch_size, pad_id=self.pad_id,
                                  images=images if self.pixels is not None else None, pixels=self.pixels,
                                  packing=self.pixels is None)  # (a vision model's rows run whole, as the learner's)
        return [lp.numpy().astype(LOGPROB_DTYPE) for lp in lps]  # each (T_i,)


class Scorer:
    """The components `cfg.kinds` asks for, and the function that applies them."""

    def __init__(self, cfg: ScorerConfig):
        self.parts: list[tuple[object, float]] = []  # (component, weight in `reward`)
        self.reference: Reference | None = None
        self.teacher: Reference | None = None  # (a teacher is a reference of another model)
        self.judge: JudgeReward | None = None  # (its connections are closed with the scorer)
        self.reward_fn: RewardFn | TaskRewards | None = None  # also kept here: it has worker processes to close
        self.remote: RemoteReward | None = None  # and this its connections
        tokenizer = None
        if cfg.tokenizer:  # OpenRLHF's reward texts are decoded from the token ids
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
        self.task_key = cfg.task_key if cfg.tasks else ""
        for kind in cfg.kinds:
            if kind == "reward_fn" and cfg.tasks:  # several tasks: each row's task picks its reward
                self.reward_fn = TaskRewards(cfg.tasks, cfg.task_key, cfg.reward_fn, cfg.reward_fn_timeout_s,
                                             tokenizer, cfg.task_options, cfg.reward_fn_options)
                log.info("tasks by column %r: %s", cfg.task_key, ", ".join(f"{t}: {p}" for t, p in cfg.tasks.items()))
                self.parts.append((self.reward_fn, cfg.reward_fn_weight))
            elif kind == "reward_fn":
                self.reward_fn = RewardFn(cfg.reward_fn, cfg.reward_fn_timeout_s, tokenizer, cfg.reward_fn_options)
                log.info("reward_fn %s: %s", cfg.reward_fn, "OpenRLHF's reward_func(queries, prompts, labels)"
                         if self.reward_fn.signature == "openrlhf" else "reward_fn(prompts, completions, labels)")
                self.parts.append((self.reward_fn, cfg.reward_fn_weight))
            elif kind == "reward_model":
                self.parts.append((RewardModel(cfg.reward_model, cfg.dtype, cfg.device, cfg.batch_size,
                                               cfg.reward_model_max_len, cfg.reward_normalize),
                                   cfg.reward_model_weight))
            elif kind == "remote":
                self.remote = RemoteReward(cfg.remote_urls, cfg.remote_protocol, cfg.remote_timeout_s,
                                           cfg.remote_retries, cfg.remote_backoff_s, tokenizer,
                                           cfg.remote_token or os.environ.get("CONVEYOR_RM_TOKEN", ""))
                self.parts.append((self.remote, cfg.remote_weight))
            elif kind == "reference":
                self.reference = Reference(cfg.reference, cfg.dtype, cfg.device, cfg.batch_size)
            elif kind == "judge":
                self.judge = JudgeReward(cfg.judge_url, cfg.judge_model, cfg.judge_template or DEFAULT_TEMPLATE,
                                         cfg.judge_max_score, cfg.judge_timeout_s, cfg.judge_retries,
                                         concurrency=cfg.judge_concurrency, max_tokens=cfg.judge_max_tokens,
                                         token=cfg.judge_token or os.environ.get("CONVEYOR_JUDGE_TOKEN", ""))
                self.parts.append((self.judge, cfg.judge_weight))
            elif kind == "teacher":
                self.teacher = Reference(cfg.teacher, cfg.dtype, cfg.device, cfg.batch_size)
            elif kind == "env":
                self.parts.append((EnvReward(), 1.0))
            else:
                raise ValueError(f"scorer.kinds: unknown kind {kind!r}")
        if cfg.overlong_buffer_len > 0:  # DAPO's soft overlong punishment: one more component, weight 1
            self.parts.append((OverlongPenalty(cfg.max_new_tokens, cfg.overlong_buffer_len,
                                               cfg.overlong_penalty_factor), 1.0))
        self.limited = WarnLimiter(log, cfg.log_every_s)
        self.pool = ThreadPoolExecutor(max(1, len(self.parts) + 2), thread_name_prefix="component")
        self.failures = Counter()  # by component name
        self.scored = 0
        self.failed = 0

    @property
    def timeouts(self) -> int:
        """Reward function calls killed for running past `scorer.reward_fn_timeout_s`."""
        return self.reward_fn.timeouts if self.reward_fn else 0

    @property
    def crashes(self) -> int:
        """Reward function calls during which its worker process died."""
        return self.reward_fn.crashes if self.reward_fn else 0

    def close(self) -> None:
        """Stop the reward function's worker process and the remote reward's connections."""
        self.pool.shutdown(wait=False)
        if self.reward_fn is not None:
            self.reward_fn.close()
        if self.remote is not None:
            self.remote.close()
        if self.judge is not None:
            self.judge.close()

    def _component(self, name: str, fn, n: int):
        """fn() guarded: an unexpected exception fails the message's samples, not the process."""
        try:
            return fn()
        except Exception as e:
            return [Score(None, f"{name} raised {type(e).__name__}: {e}")] * n

    def score(self, rollouts: Sequence[Rollout]) -> list[ScoredRollout]:
        n = len(rollouts)
        # the components side by side (one thread each): a slow one (a judge, a remote server, a
        # verifier's worker) holds up the message by its own time only, not by the sum of all
        jobs = {comp.name: (lambda c=comp: c.score(rollouts)) for comp, _ in self.parts}
        jobs.update({name: (lambda m=model: m.logprobs(rollouts)) for name, model in
                     (("reference", self.reference), ("teacher", self.teacher)) if model is not None})
        if len(jobs) > 1:
            futures = {name: self.pool.submit(self._component, name, fn, n) for name, fn in jobs.items()}
            results = {name: f.result() for name, f in futures.items()}
        else:
            results = {name: self._component(name, fn, n) for name, fn in jobs.items()}
        ref: list = [None] * n
        teacher: list = [None] * n
        for name in ("reference", "teacher"):
            if name in results:
                got = results[name]
                lps = [None if isinstance(x, Score) else x for x in got]
                ref, teacher = (lps, teacher) if name == "reference" else (ref, lps)
                results[name] = [x if isinstance(x, Score) else Score(0.0) for x in got]
        out = []
        for i, r in enumerate(rollouts):
            scores, errors, metadata = {}, [], {}
            if self.task_key and (task := task_of(r.columns, self.task_key)) is not None:
                metadata[TASK] = task
            for name, res in results.items():
                s = res[i]
                if s.value is None:
                    errors.append(f"{name}: {s.error}")
                    self.failures[name] += 1
                    self.limited.warn(name, f"group {r.group_id} sample {r.sample_index}: {name}: {s.error}")
                elif name not in ("reference", "teacher"):
                    scores[name] = s.value
                    metadata.update(_openrlhf_extras(s, metadata))
            reward = 0.0 if errors else sum(w * scores[c.name] for c, w in self.parts)
            out.append(ScoredRollout(r, reward=reward, scores=scores, ref_logprobs=ref[i],
                                     failed=bool(errors), error="; ".join(errors), metadata=metadata,
                                     teacher_logprobs=teacher[i]))
        self.scored += n
        self.failed += sum(s.failed for s in out)
        return out


def _openrlhf_extras(s: Score, metadata: dict) -> dict[str, float]:
    """What a component's OpenRLHF-style answer adds to a sample's metadata: its `scores` summed into
    FILTER_SCORE (with any other component's), its `extra_logs` under EXTRA_LOG_PREFIX."""
    out = {EXTRA_LOG_PREFIX + k: v for k, v in (s.extra or {}).items()}
    if s.filter_score is not None:
        out[FILTER_SCORE] = metadata.get(FILTER_SCORE, 0.0) + s.filter_score
    return out


def run(cfg: ScorerConfig, stop: threading.Event | None = None) -> int:
    """Score until a signal comes (or `stop` is set); the exit code. Without `stop`, SIGTERM/SIGINT
    are handled (on the main thread)."""
    worker_id = cfg.worker_id or f"scorer-{socket.gethostname()}-{os.getpid()}"
    if stop is None:
        stop = threading.Event()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda signum, frame: stop.set())
    scorer = Scorer(cfg)
    client = BufferClient(cfg.buffer_host, cfg.buffer_port)
    log.info("%s ready: %s, buffer %s:%d", worker_id, ", ".join(cfg.kinds), cfg.buffer_host, cfg.buffer_port)
    mark_ready("scorer", worker_id=worker_id)
    bad_messages = 0
    t_log, last_scored, busy_s = time.monotonic(), 0, 0.0
    try:
        while not stop.is_set():
            try:
                rollouts = client.pull_rollouts(timeout_s=cfg.poll_s)
            except ProtocolError as e:
                bad_messages += 1
                scorer.limited.warn("protocol", f"skipped a malformed rollouts message: {e}")
                continue
            if rollouts:
                t0 = time.monotonic()
                client.push_scored(scorer.score(rollouts))
                busy_s += time.monotonic() - t0
            if time.monotonic() - t_log >= cfg.log_every_s and scorer.scored > last_scored:
                dt = time.monotonic() - t_log
                log.info("%d samples in %.1fs (%.1f/s, busy %.0f%%); total scored=%d failed=%d %s bad_messages=%d "
                         "reward_fn_timeouts=%d reward_fn_crashes=%d", scorer.scored - last_scored, dt,
                         (scorer.scored - last_scored) / dt, 100 * busy_s / dt, scorer.scored, scorer.failed,
                         dict(scorer.failures), bad_messages, scorer.timeouts, scorer.crashes)
                t_log, last_scored, busy_s = time.monotonic(), scorer.scored, 0.0
    finally:
        log.info("exiting: scored=%d failed=%d %s reward_fn_timeouts=%d reward_fn_crashes=%d", scorer.scored,
                 scorer.failed, dict(scorer.failures), scorer.timeouts, scorer.crashes)
        client.close()
        scorer.close()
    return 0
