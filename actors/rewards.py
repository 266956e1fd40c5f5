"""Reward components a scorer combines: a Python reward function, a reward model, a remote HTTP reward.

Each has `name` and `score(rollouts) -> list[Score]`, one per rollout. A component never raises for
bad input or a bad reward: the samples it cannot score get `Score(None, why)`, the scorer marks them
failed (the buffer then drops their group and counts it) and keeps going.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import numbers
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple, Sequence

from buffer.protocol import Rollout

log = logging.getLogger("conveyor.scorer")


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


class RewardFn:
    """`reward_fn(prompts, completions, labels) -> list[float]` from a Python file, called batched."""

    name = "reward_fn"

    def __init__(self, path: str):
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"scorer.reward_fn={path!r}: no such file")
        spec = importlib.util.spec_from_file_location(f"conveyor_reward_{p.stem}", p)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.fn = getattr(module, "reward_fn", None)
        if not callable(self.fn):
            raise AttributeError(f"scorer.reward_fn={path!r} defines no callable `reward_fn`")
        self.path = str(p)

    def _call(self, rollouts: Sequence[Rollout]) -> list[Score]:
        try:
            raw = self.fn([r.prompt for r in rollouts], [r.completion for r in rollouts], [r.label for r in rollouts])
        except Exception as e:  # user code: anything may come out of it
            return [Score(None, f"reward_fn raised {type(e).__name__}: {e}")] * len(rollouts)
        return check_rewards(raw, len(rollouts), "reward_fn")

    def score(self, rollouts: Sequence[Rollout]) -> list[Score]:
        out = self._call(rollouts)
        if len(rollouts) > 1 and all(s.error.startswith("reward_fn raised") for s in out):
            # One bad sample should not fail the whole message: find which ones raise.
            out = [self._call([r])[0] for r in rollouts]
        return out


class RewardModel:
    """An `AutoModelForSequenceClassification` with one label: its score of prompt + completion text
    at the last token. Texts are re-tokenized with the reward model's own tokenizer (it need not
    share the policy's vocabulary)."""

    name = "reward_model"

    def __init__(self, path: str, dtype: str = "float32", device: str = "cpu", batch_size: int = 16,
                 max_len: int = 1024):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

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
