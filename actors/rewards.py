"""Reward components a scorer combines: a Python reward function, a reward model, a remote HTTP reward,
and DAPO's soft overlong punishment (`overlong_penalty`, a function of the completion's length).

Each has `name` and `score(rollouts) -> list[Score]`, one per rollout. A component never raises for
bad input or a bad reward: the samples it cannot score get `Score(None, why)`, the scorer marks them
failed (the buffer then drops their group and counts it) and keeps going.

The reward function runs in a worker process of its own (`spawn`ed, so nothing of the scorer's state
is forked into it), which imports the user's file once and then answers one request per message:

    scorer  --{"prompts": [...], "completions": [...], "labels": [...]}-->  worker
    scorer  <--{"rewards": [...]}  or  {"error": "TypeName: message"}--  worker

each a msgpack frame on a pipe (never pickle). A call that runs past `timeout_s`, or a worker that
dies, fails that call's samples; the worker is then SIGKILLed with anything it started, and a fresh
one takes the next call. A reward function that hangs costs one timeout, not the scorer.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Sequence

import msgpack

if TYPE_CHECKING:  # only for annotations: the worker process imports this module and should start fast
    from buffer.messages import Rollout

log = logging.getLogger("conveyor.scorer")

START_TIMEOUT_S = 300.0  # a fresh worker may take this long to start Python and import the user's file
CLOSE_WAIT_S = 5.0  # a closed worker gets this long to exit on its own before it is killed


class Score(NamedTuple):
    value: float | None  # None when the sample could not be scored
    error: str = ""


def check_rewards(raw, n: int, source: str) -> list[Score]:
    """`n` scores from what a reward source returned: a list of n finite numbers, else failures."""
    if not isinstance(raw, (list, tuple)) and not hasattr(raw, "tolist"):
        return [Score(None, f"{source} returned {type(raw).__name__}, expected a list of {n} numbers")] * n
    raw = raw.tolist() if hasattr(raw, "tolist") else list(raw)
    if len(raw) != n:
        return [Score(None, f"{source} returned {len(raw)} rewards for {n} samples")] * n
    out = []
    for x in raw:
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            out.append(Score(None, f"{source} returned {x!r} ({type(x).__name__}), not a number"))
        elif not math.isfinite(float(x)):
            out.append(Score(None, f"{source} returned a non-finite reward ({float(x)})"))
        else:
            out.append(Score(float(x)))
    return out


def overlong_penalty(n_tokens: int, max_new_tokens: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment (<= 0): nothing up to max_new_tokens - buffer_len tokens, then
    falling linearly to -factor at max_new_tokens (and staying there past it). buffer_len 0: off."""
    exceed = n_tokens - (max_new_tokens - buffer_len)
    if buffer_len <= 0 or exceed <= 0:
        return 0.0
    return -min(exceed / buffer_len, 1.0) * factor


class OverlongPenalty:
    """`overlong_penalty` as a reward component (`scores["overlong"]`): a function of each
    completion's length, so it never fails."""

    name = "overlong"

    def __init__(self, max_new_tokens: int, buffer_len: int, factor: float):
        self.max_new_tokens, self.buffer_len, self.factor = max_new_tokens, buffer_len, factor

    def score(self, rollouts) -> list[Score]:
        return [Score(overlong_penalty(len(r.completion_ids), self.max_new_tokens, self.buffer_len, self.factor))
                for r in rollouts]


class EnvReward:
    """The reward an episode's environment gave (`Rollout.env_reward`, the sum of its steps'): a
    component like the others, weight 1. A rollout that played no environment fails it."""

    name = "env"

    def score(self, rollouts) -> list[Score]:
        raw = [r.env_reward for r in rollouts]
        if any(x is None for x in raw):
            return [Score(None, "scorer.kinds has `env` but the rollout played no environment "
                                "(generator.env is empty)")] * len(rollouts)
        return check_rewards(raw, len(rollouts), "the environment")


class RewardFn:
    """`reward_fn(prompts, completions, labels) -> list[float]` from a Python file, called batched in a
    worker process (see the module docstring). `timeouts` and `crashes` count the calls lost to a
    timeout or a dead worker; `close()` stops the worker."""

    name = "reward_fn"

    def __init__(self, path: str, timeout_s: float = 60.0):
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"scorer.reward_fn={path!r}: no such file")
        self.path, self.timeout_s = str(p), timeout_s
        self.timeouts = 0  # calls killed for running past timeout_s
        self.crashes = 0  # calls during which the worker died
        self.proc = self.conn = None
        self._start()  # a file that does not import fails the scorer now, with the import's error

    def _start(self) -> None:
        """A fresh worker, returned once it has imported the file; raises what went wrong if it could not."""
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(self.path, child), name="reward_fn")
        self.proc.start()
        child.close()  # the worker holds the only other end: its exit reads as EOF here, and ours there
        # Not a daemon (the user's code may start processes of its own), so multiprocessing joins it at
        # exit; this closes it before that (atexit runs the last registered first).
        atexit.register(self.close)
        error = self._handshake()
        if error is not None:
            self.close()
            raise error

    def _handshake(self) -> Exception | None:
        """None once the worker says it imported the file and found `reward_fn`, else what went wrong."""
        where = f"scorer.reward_fn={self.path!r}"
        try:
            if not self.conn.poll(START_TIMEOUT_S):
                return TimeoutError(f"{where} did not import within {START_TIMEOUT_S:g}s")
            ready = msgpack.unpackb(self.conn.recv_bytes())
        except (EOFError, OSError):
            return RuntimeError(f"{where}: the worker died importing it ({_exit_reason(self._kill())})")
        if "error" in ready:
            return ImportError(f"{where} failed to import: {ready['error']}")
        if not ready["ready"]:
            return AttributeError(f"{where} defines no callable `reward_fn`")
        return None

    def _kill(self) -> int | None:
        """SIGKILL the worker and whatever it started (it leads a process group); its exit code.

        The group is killed before the worker is reaped: until then its pid, the group's id, cannot be
        reused by another process."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # not a group leader yet
            self.proc.kill()
        self.proc.join()
        self.conn.close()
        code, self.proc, self.conn = self.proc.exitcode, None, None
        atexit.unregister(self.close)
        return code

    def close(self) -> None:
        """Stop the worker: it exits when its pipe closes; killed if it has not after CLOSE_WAIT_S."""
        if self.proc is not None:
            self.conn.close()
            multiprocessing.connection.wait([self.proc.sentinel], CLOSE_WAIT_S)  # exited, not reaped
            self._kill()  # also takes down any process the user's code left behind

    def _call(self, rollouts: Sequence[Rollout]) -> list[Score]:
        n = len(rollouts)
        if self.proc is None:  # the last call killed it
            try:
                self._start()
            except Exception as e:
                return [Score(None, f"reward_fn worker could not restart: {e}")] * n
        request = msgpack.packb({"prompts": [r.prompt for r in rollouts],
                                 "completions": [r.completion for r in rollouts],
                                 "labels": [r.label for r in rollouts]})
        try:
            self.conn.send_bytes(request)
            if not self.conn.poll(self.timeout_s):
                self._kill()
                self.timeouts += 1
                return [Score(None, f"reward_fn did not return within {self.timeout_s:g}s (worker killed)")] * n
            reply = msgpack.unpackb(self.conn.recv_bytes())
        except (EOFError, OSError):  # the worker is gone: a closed pipe, or a reset one
            self.crashes += 1
            return [Score(None, f"reward_fn worker died ({_exit_reason(self._kill())})")] * n
        if "error" in reply:
            return [Score(None, f"reward_fn raised {reply['error']}")] * n
        return check_rewards(reply["rewards"], n, "reward_fn")

    def score(self, rollouts: Sequence[Rollout]) -> list[Score]:
        out = self._call(rollouts)
        if len(rollouts) > 1 and all(s.error.startswith("reward_fn raised") for s in out):
            # One bad sample should not fail the whole message: find which ones raise. A timeout ends
            # the search (each would cost another timeout_s) and fails the samples not yet tried.
            out = []
            for r in rollouts:
                timeouts = self.timeouts
                out.append(self._call([r])[0])
                if self.timeouts > timeouts:
                    out += [out[-1]] * (len(rollouts) - len(out))
                    break
        return out


def _worker(path: str, conn) -> None:
    """The worker process: import `path` once, then answer requests until the scorer closes the pipe."""
    # A group of its own: a Ctrl-C to the scorer's terminal does not reach it (the scorer decides when
    # it stops), and the scorer's SIGKILL to the group reaches anything the user's code started.
    os.setpgrp()
    try:
        p = Path(path)
        spec = importlib.util.spec_from_file_location(f"conveyor_reward_{p.stem}", p)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = getattr(module, "reward_fn", None)
    except Exception as e:
        conn.send_bytes(msgpack.packb({"error": f"{type(e).__name__}: {e}"}))
        return
    conn.send_bytes(msgpack.packb({"ready": callable(fn)}))
    if not callable(fn):
        return
    while True:
        try:
            request = msgpack.unpackb(conn.recv_bytes())
        except EOFError:  # the scorer closed the pipe (or exited)
            return
        try:
            raw = fn(request["prompts"], request["completions"], request["labels"])
            # numpy/torch arrays and scalars as plain numbers; check_rewards (in the scorer) judges them
            reply = msgpack.packb({"rewards": raw.tolist() if hasattr(raw, "tolist") else raw}, default=_plain)
        except Exception as e:  # user code: anything may come out of it
            reply = msgpack.packb({"error": f"{type(e).__name__}: {e}"})
        conn.send_bytes(reply)


def _plain(x):
    """msgpack's fallback for values it cannot send as they are: numpy scalars become floats."""
    if isinstance(x, numbers.Real):
        return float(x)
    raise TypeError(f"reward_fn returned a {type(x).__name__}, which cannot be sent to the scorer")


def _exit_reason(code: int | None) -> str:
    return f"killed by signal {-code} ({signal.strsignal(-code)})" if code and code < 0 else f"exit code {code}"


class RewardModel:
    """An `AutoModelForSequenceClassification` with one label: its score of prompt + completion text
    at the last token. Texts are re-tokenized with the reward model's own tokenizer (it need not
    share the policy's vocabulary)."""

    name = "reward_model"

    def __init__(self, path: str, dtype: str = "float32", device: str = "cpu", batch_size: int = 16,
                 max_len: int = 1024):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from learner.modeling import apply_memory_share

        apply_memory_share(device)  # (the device plan's share, where the scorer shares its GPU)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype))
        self.model.to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.truncation_side = "left"  # keep the completion, the part being judged
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            # The model pools at the last non-pad token; it must know which id pads.
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if self.model.config.num_labels != 1:
            raise ValueError(f"scorer.reward_model={path!r} has num_labels={self.model.config.num_labels}, expected 1")
        self.device, self.batch_size, self.max_len = device, batch_size, max_len

    def score(self, rollouts: Sequence[Rollout]) -> list[Score]:
        import torch

        texts = [r.prompt + r.completion for r in rollouts]
        out: list[Score] = []
        with torch.no_grad():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(texts[i:i + self.batch_size], padding=True, truncation=True,
                                     max_length=self.max_len, return_tensors="pt").to(self.device)
                scores = self.model(**enc).logits[:, 0].float()  # (B,) pooled at the last real token
                out.extend(check_rewards(scores.tolist(), len(scores), "reward_model"))
        return out


class RemoteReward:
    """POST `{"prompts", "completions", "labels"}` as JSON, expect `{"rewards": [...]}`.

    Connection errors, timeouts and 5xx answers are retried with exponential backoff; after the last
    attempt (or on an answer that is not a reward list) the batch's samples fail with the reason.
    """

    name = "remote"

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 0.5):
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s

    def score(self, rollouts: Sequence[Rollout]) -> list[Score]:
        n = len(rollouts)
        body = json.dumps({"prompts": [r.prompt for r in rollouts], "completions": [r.completion for r in rollouts],
                           "labels": [r.label for r in rollouts]}).encode()
        last = ""
        for attempt in range(self.retries):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            req = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    answer = json.loads(resp.read())
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code} {e.reason}"
                if e.code < 500:  # the request itself is wrong: asking again will not help
                    break
                continue
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last = f"unreachable ({getattr(e, 'reason', e)})"
                continue
            except ValueError as e:
                return [Score(None, f"remote reward {self.url} answered with invalid JSON: {e}")] * n
            if not isinstance(answer, dict) or "rewards" not in answer:
                return [Score(None, f"remote reward {self.url} answered without a `rewards` list")] * n
            return check_rewards(answer["rewards"], n, f"remote reward {self.url}")
        return [Score(None, f"remote reward {self.url} failed after {attempt + 1} attempt(s): {last}")] * n
