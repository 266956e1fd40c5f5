"""Reward components a scorer combines: a Python reward function (actors/reward_files.py), a reward
model, a remote HTTP reward, and DAPO's soft overlong punishment (`overlong_penalty`, a function of
the completion's length).

Each has `name` and `score(rollouts) -> list[Score]`, one per rollout. A component never raises for
bad input or a bad reward: the samples it cannot score get `Score(None, why)`, the scorer marks them
failed (the buffer then drops their group and counts it) and keeps going.

A reward function or a remote reward may answer as OpenRLHF's do (`read_reply`): `rewards`, and
optionally `scores` (what dynamic sampling judges instead of the reward: `Score.filter_score`) and
`extra_logs` (named numbers the learner logs per step: `Score.extra`).

The remote reward (`RemoteReward`) POSTs JSON to one or more URLs, a message's samples split into one
contiguous shard per URL, sent at once:

    conveyor protocol:  {"prompts", "completions", "labels"}  ->  {"rewards", "scores"?, "extra_logs"?}
    openrlhf protocol:  {"query", "prompts", "labels"}        ->  {"rewards", "scores"?, "extra_logs"?}

(`query` = prompt + completion text, `openrlhf_texts`). Connection errors, timeouts and 5xx answers
are retried with exponential backoff, 4xx answers are not; a URL that still fails fails its own
shard's samples, with its reason.
"""

from __future__ import annotations

import math
import numbers
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

if TYPE_CHECKING:  # only for annotations: the reward function's worker imports this module and should start fast
    from buffer.messages import Rollout


class Score(NamedTuple):
    value: float | None  # None when the sample could not be scored
    error: str = ""
    filter_score: float | None = None  # OpenRLHF's `scores`: judged by dynamic sampling instead of the reward
    extra: dict[str, float] | None = None  # OpenRLHF's `extra_logs`: named numbers, logged as per-step means


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


def _finite(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(float(x))


def extra_values(value, n: int) -> list[float | None] | None:
    """One extra_logs entry as `n` per-sample numbers (None where one is not finite): a list of n
    numbers, or one number (a list of one too) for every sample (OpenRLHF calls a reward function one
    sample at a time, so a file's `reward.mean()` is per sample there). None: not readable."""
    if _finite(value):
        return [float(value)] * n
    if isinstance(value, (list, tuple)) and len(value) in (1, n):
        values = [float(x) if _finite(x) else None for x in value]
        return values * n if len(values) == 1 else values
    return None


def read_reply(answer: Any, n: int, source: str) -> list[Score]:
    """The scores of `n` samples from a reward source's answer, plain values already (lists, numbers):
    a list of n rewards, or a dict `{"rewards", "scores"?, "extra_logs"?}` as OpenRLHF's reward
    functions and servers return. Bad rewards or scores fail the samples; an extra_logs entry that
    is neither one number nor n of them is left out (logs are not worth failing samples for)."""
    if not isinstance(answer, dict):
        return check_rewards(answer, n, source)
    if answer.get("rewards") is None:
        return [Score(None, f"{source} returned a dict without `rewards` (keys {sorted(answer)})")] * n
    out = check_rewards(answer["rewards"], n, source)
    if answer.get("scores") is not None:
        scores = check_rewards(answer["scores"], n, f"{source} (its scores)")
        out = [s if s.value is None else (Score(None, f.error) if f.value is None else s._replace(filter_score=f.value))
               for s, f in zip(out, scores)]
    logs = answer.get("extra_logs") or {}
    if not isinstance(logs, dict):
        return out
    extra: list[dict[str, float]] = [{} for _ in range(n)]
    for name, value in logs.items():
        values = extra_values(value, n)
        for i, v in enumerate(values or ()):
            if v is not None:
                extra[i][str(name)] = v
    return [s._replace(extra=e) if s.value is not None and e else s for s, e in zip(out, extra)]


def openrlhf_texts(rollouts: Sequence[Rollout], tokenizer=None) -> tuple[list[str], list[str]]:
    """(queries, prompts) as OpenRLHF gives them to a reward function or server: with the policy's
    `tokenizer`, each prompt's and prompt + completion's token ids decoded with special tokens kept
    (the chat template's markers and the end token, as OpenRLHF decodes them); without one, the
    prompt's text and prompt + completion text."""
    if tokenizer is None:
        return [r.prompt + r.completion for r in rollouts], [r.prompt for r in rollouts]
    queries = [tokenizer.decode([*r.prompt_ids.tolist(), *r.completion_ids.tolist()], skip_special_tokens=False)
               for r in rollouts]
    return queries, [tokenizer.decode(r.prompt_ids.tolist(), skip_special_tokens=False) for r in rollouts]


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
        out = check_rewards(raw, len(rollouts), "the environment")
        # an OpenRLHF agent's `scores` and `extra_logs` (Rollout.env_info): passed on as a reward file's are
        return [s if s.value is None or not r.env_info else s._replace(
                    filter_score=r.env_info.get("filter_score"),
                    extra={k[len("extra/"):]: v for k, v in r.env_info.items() if k.startswith("extra/")})
                for s, r in zip(out, rollouts)]


class RewardModel:
    """An `AutoModelForSequenceClassification` with one label: its score of prompt + completion text
    at the last token. Texts are re-tokenized with the reward model's own tokenizer (it need not
    share the policy's vocabulary)."""

    name = "reward_model"

    def __init__(self, path: str, dtype: str = "float32", device: str = "cpu", batch_size: int = 16,
                 max_len: int = 1024, normalize: bool = False, normalize_key: str = "scorer.reward_normalize"):
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
        # OpenRLHF's --reward.normalize_enable: (raw - mean) / std with the statistics its reward model
        # training stored in config.json
        self.mean, self.std = stored_mean_std(self.model.config, path, normalize_key) if normalize \
            else (0.0, 1.0)

    def score(self, rollouts: Sequence[Rollout]) -> list[Score]:
        texts = [r.prompt + r.completion for r in rollouts]
        out: list[Score] = []
        for i in range(0, len(texts), self.batch_size):
            ids = self.tokenizer(texts[i:i + self.batch_size], truncation=True, max_length=self.max_len)["input_ids"]
            out.extend(check_rewards(self.normalized(self.raw_scores(ids)), len(ids), "reward_model"))
        return out

    def raw_scores(self, ids: Sequence[Sequence[int]]) -> list[float]:
        """The head's output at each sequence's last token (no normalisation): token ids in, one
        forward for all of them (`launch.serve_rm` batches its requests' ids into it too)."""
        import torch

        width = max(len(x) for x in ids)
        pad = int(self.model.config.pad_token_id)
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(ids), width), dtype=torch.long)  # (B, T)
        for i, x in enumerate(ids):
            # padded on the right: each text keeps the positions it has alone, and the model pools
            # at its last non-pad token
            input_ids[i, :len(x)] = torch.as_tensor(list(x), dtype=torch.long)
            mask[i, :len(x)] = 1
        with torch.no_grad():
            out = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device))
        return out.logits[:, 0].float().tolist()  # (B,)

    def normalized(self, raw: Sequence[float]) -> list[float]:
        """(raw - mean) / std with the stored statistics (`normalize`), else raw."""
        return [(r - self.mean) / self.std for r in raw]




class RemoteReward:
    """Rewards from HTTP servers (see the module docstring): `urls` share each message, shard i going
    to URL (start + i) mod len(urls), start moving on by one per message (so one-sample messages
    spread over the URLs too). `protocol`: `conveyor` or `openrlhf` (the request's fields; either
    answer is read by `read_reply`). `tokenizer`: the policy's, for OpenRLHF's `query` text; `token`:
    sent as `Authorization: Bearer` when set."""

    name = "remote"

    def __init__(self, urls: Sequence[str], protocol: str = "conveyor", timeout_s: float = 30.0, retries: int = 3,
                 backoff_s: float = 0.5, tokenizer=None, token: str = ""):
        import httpx

        if not urls:
            raise ValueError("scorer.remote_url: no URL given")
        self.urls, self.protocol, self.tokenizer = list(urls), protocol, tokenizer
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        # pooled connections, shared by the shard threads; a bearer token for a server that asks one
        # (launch.serve_rm with a token)
        self.client = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {token}"} if token else None)
        self.pool = ThreadPoolExecutor(len(self.urls), thread_name_prefix="remote-reward")
        self.calls = 0

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    def _body(self, rollouts: Sequence[Rollout]) -> dict:
        labels = [r.label for r in rollouts]
        if self.protocol == "openrlhf":
            queries, prompts = openrlhf_texts(rollouts, self.tokenizer)
            return {"query": queries, "prompts": prompts, "labels": labels}
        return {"prompts": [r.prompt for r in rollouts], "completions": [r.completion for r in rollouts],
                "labels": labels}

    def score(self, rollouts: Sequence[Rollout]) -> list[Score]:
        n = len(rollouts)
        if n == 0:
            return []
        size = math.ceil(n / min(len(self.urls), n))  # OpenRLHF's split: equal shards, the last one short
        start, self.calls = self.calls, self.calls + 1
        shards = [(self.urls[(start + i) % len(self.urls)], rollouts[lo:lo + size])
                  for i, lo in enumerate(range(0, n, size))]
        futures = [self.pool.submit(self._post, url, shard) for url, shard in shards]
        return [s for f in futures for s in f.result()]

    def _post(self, url: str, rollouts: Sequence[Rollout]) -> list[Score]:
        """One shard's scores: its request, retried; its samples failed with the reason if it never succeeds."""

        n = len(rollouts)
        try:
            body = self._body(rollouts)
        except Exception as e:  # (a tokenizer that cannot decode the ids)
            return [Score(None, f"remote reward {url}: building the request raised {type(e).__name__}: {e}")] * n
        last = ""
        for attempt in range(self.retries):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            resp, last, again = http_attempt(self.client, url, body, self.timeout_s)
            if resp is None:
                if not again:
                    break
                continue
            try:
                answer = resp.json()
            except ValueError as e:
                return [Score(None, f"remote reward {url} answered with invalid JSON: {e}")] * n
            if not isinstance(answer, dict) or "rewards" not in answer:
                return [Score(None, f"remote reward {url} answered without a `rewards` list")] * n
            return read_reply(answer, n, f"remote reward {url}")
        return [Score(None, f"remote reward {url} failed after {attempt + 1} attempt(s): {last}")] * n


def http_attempt(client, url: str, body: dict, timeout_s: float, retry_statuses: Sequence[int] = ()):
    """One POST of `body` as JSON: (the response, "", False) when it answered below 400; else
    (None, why, whether another attempt may help: a timeout, a connection that failed, a 5xx or one
    of `retry_statuses`; a 4xx says the request itself is wrong)."""
    import httpx

    try:
        resp = client.post(url, json=body)
    except httpx.TimeoutException:
        return None, f"no answer within {timeout_s:g}s", True
    except httpx.RequestError as e:  # refused, reset, DNS: the server may be back for the next try
        return None, f"unreachable ({type(e).__name__}: {e})", True
    if resp.status_code >= 400:
        why = f"HTTP {resp.status_code} {resp.reason_phrase}: {resp.text[:200]}"
        return None, why, resp.status_code >= 500 or resp.status_code in retry_statuses
    return resp, "", False


def stored_mean_std(config, path: str, key: str) -> tuple[float, float]:
    """The reward model's stored `mean` and `std` (OpenRLHF's reward model config keys); ConfigError
    if the folder has none or they cannot normalise."""
    from common.config import ConfigError

    mean, std = getattr(config, "mean", None), getattr(config, "std", None)
    if mean is None or std is None:
        raise ConfigError(f"{key}=true but {path}/config.json has no `mean` and `std` to normalise "
                          f"rewards with (OpenRLHF's reward model training stores them)")
    try:
        mean, std = float(mean), float(std)
    except (TypeError, ValueError):
        raise ConfigError(f"{path}/config.json: mean={mean!r} std={std!r} are not numbers") from None
    if not (math.isfinite(mean) and math.isfinite(std) and std > 0):
        raise ConfigError(f"{path}/config.json: mean={mean!r} std={std!r} cannot normalise (std must be > 0)")
    return mean, std
