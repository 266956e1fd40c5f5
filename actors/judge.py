"""An LLM as judge: a reward component (`scores["judge"]`) that asks a chat model to grade each
completion against a rubric and reads the grade from its answer.

The judge is any OpenAI-compatible chat endpoint (vLLM's `vllm serve`, SGLang, a hosted API). For
each rollout:

    POST {url}/chat/completions  {"model", "messages": [{"role": "user", "content": <rubric>}],
                                  "max_tokens", "temperature"}
        -> {"choices": [{"message": {"content": "... Score: 7"}}]}   reward = 7 / max_score

The rubric is `template` filled with the sample's text (`{prompt}`, `{response}`, and `{label}`,
the reference answer, when the template asks for it): the judge reads text, never the policy's
token ids, so it need not share the policy's tokenizer. `parse_score` reads the grade
conservatively: the number after the last `Score:`, else an `N/10` (N over `max_score`) that ends
the answer; anything else, or a grade outside [0, max_score], is no grade. Without `model`, the
first model `GET {url}/models` lists is used (asked once, when the first message comes).

Batching is concurrency: an OpenAI chat request holds one conversation, so a message's samples go
out as single requests, `concurrency` at a time over pooled connections, and the judge's server
batches what arrives together (vLLM's continuous batching does). Each request is tried `retries`
times with exponential backoff: a connection error, a timeout, a 5xx or 429, and an answer without
a grade (`malformed`, the judge's text quoted in the reason) are tried again; any other 4xx is not
(the request itself is wrong). So a sample waits at most about retries x timeout_s (plus the
backoff), and a message of n samples about ceil(n / concurrency) times that.

When the judge cannot grade a sample it fails the sample (`Score(None, why)`): the buffer drops its
group and counts it, as for any reward that fails. A 0 would teach the policy that the answer was
bad when only the judge was. Each score carries `extra` {"judge/malformed": 1 if any of the
sample's answers had no grade, "judge/attempts": requests made}, which the learner logs as
`reward/extra/judge/...`; `calls`, `failures` and `malformed` count requests, failed samples and
ungraded answers over the component's life.
"""

from __future__ import annotations

import math
import re
import string
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Sequence

from actors.rewards import Score, http_attempt

if TYPE_CHECKING:
    from buffer.rollouts import Rollout

FIELDS = ("prompt", "response", "label")  # what a template may name

DEFAULT_TEMPLATE = """You are grading a response to a prompt.

[Prompt]
{prompt}

[Response]
{response}

Judge whether the response answers the prompt correctly, completely and clearly. Give a score from
0 (wrong or useless) to 10 (fully correct and helpful). Explain your judgement in a few sentences,
then end with a final line of exactly this form, N being a whole number from 0 to 10:
Score: N"""

_NUMBER = r"(\d+(?:\.\d+)?)(?!\w|\.\d)"  # no sign: a negative grade is no grade
# `Score: 7`, `**Score:** 7`, `score = 7`, optionally `/10` after the number
_SCORE = re.compile(r"\bscore\**\s*[:=]\s*\**\s*" + _NUMBER + r"(?:\s*/\s*" + _NUMBER + ")?", re.IGNORECASE)
_SCORE_WORD = re.compile(r"\bscore\**\s*[:=]", re.IGNORECASE)
_OUT_OF_AT_END = re.compile(r"(?<![\w.])" + _NUMBER + r"\s*/\s*" + _NUMBER + r"[\s*.!)\]]*\Z")
QUOTE_CHARS = 160  # of a malformed answer, in a failed sample's reason


def check_template(template: str, key: str = "scorer.judge_template") -> set[str]:
    """The placeholders of `template`; ValueError naming what is wrong unless it is a format string
    whose only placeholders are {prompt}, {response} (required) and {label}."""
    try:
        parsed = list(string.Formatter().parse(template))
        # (a format spec may hold placeholders of its own: `{response:{width}}`)
        parsed += [p for _, _, spec, _ in parsed if spec for p in string.Formatter().parse(spec)]
    except ValueError as e:  # a lone `{` or `}` (literal braces are written `{{` and `}}`)
        raise ValueError(f"{key}: not a format string ({e}); write literal braces as {{{{ and }}}}") from None
    names = [name for _, name, _, _ in parsed if name is not None]
    unknown = sorted({n for n in names if n not in FIELDS}, key=names.index)
    if unknown:
        raise ValueError(f"{key}: unknown placeholder(s) {', '.join('{' + n + '}' for n in unknown)}; "
                         f"known: {{prompt}}, {{response}}, {{label}}")
    if "response" not in names:
        raise ValueError(f"{key}: has no {{response}} placeholder: the judge would not see the completion")
    try:
        template.format(prompt="", response="", label="")
    except ValueError as e:  # a format spec text cannot take: `{response:d}`
        raise ValueError(f"{key}: cannot be filled in ({e})") from None
    return set(names)


def parse_score(text: str, max_score: float = 10.0) -> float | None:
    """The grade in a judge's answer: the number after the last `Score:` (any case; `Score: 7/10`
    too, the denominator being max_score), else an `N/max_score` the answer ends with; None when
    there is none, or it lies outside [0, max_score]."""
    if not isinstance(text, str):
        return None
    words = list(_SCORE_WORD.finditer(text))
    if words:
        m = _SCORE.match(text, words[-1].start())  # the last `Score:` must be followed by the grade
        if m is None:
            return None
        value, over = m.group(1), m.group(2)
    else:
        m = _OUT_OF_AT_END.search(text)
        if m is None:
            return None
        value, over = m.group(1), m.group(2)
    if over is not None and float(over) != max_score:  # a grade on another scale than the rubric's
        return None
    score = float(value)
    return score if math.isfinite(score) and 0 <= score <= max_score else None


def quote(text: str, n: int = QUOTE_CHARS) -> str:
    """The end of a judge's answer (where the grade should have been), for a failure's reason."""
    text = text if len(text) <= n else "..." + text[-n:]
    return repr(text)


class JudgeReward:
    """A judge model's grade of each completion, / max_score (see the module docstring). `url`: the
    OpenAI-compatible base URL (`http://host:8000/v1`); `token`: sent as `Authorization: Bearer`."""

    name = "judge"

    def __init__(self, url: str, model: str = "", template: str = DEFAULT_TEMPLATE, max_score: float = 10.0,
                 timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 0.5, concurrency: int = 8,
                 max_tokens: int = 256, temperature: float = 0.0, token: str = ""):
        import httpx

        if not url.startswith(("http://", "https://")):
            raise ValueError(f"scorer.judge_url={url!r} must start with http:// or https://")
        self.fields = check_template(template)
        if not (math.isfinite(max_score) and max_score > 0):
            raise ValueError(f"scorer.judge_max_score={max_score!r} must be a positive number")
        if retries < 1 or concurrency < 1 or max_tokens < 1:
            raise ValueError(f"scorer.judge_retries={retries}, judge_concurrency={concurrency} and "
                             f"judge_max_tokens={max_tokens} must each be >= 1")
        self.url, self.model, self.template, self.max_score = url.rstrip("/"), model, template, max_score
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.max_tokens, self.temperature = max_tokens, temperature
        # one pooled connection per worker thread: a sample never waits for a connection, only for the judge
        self.client = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {token}"} if token else None,
                                   limits=httpx.Limits(max_connections=concurrency,
                                                       max_keepalive_connections=concurrency))
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="judge")
        self.lock = threading.Lock()  # the counters and the model name, written from the pool's threads
        self.calls = 0  # chat requests sent
        self.failures = 0  # samples failed
        self.malformed = 0  # answers without a grade

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    def render(self, rollout: Rollout) -> str:
        """The rubric for one sample: the template with its text filled in."""
        return self.template.format(prompt=rollout.prompt, response=rollout.completion,
                                    label="" if rollout.label is None else rollout.label)

    def score(self, rollouts: Sequence[Rollout]) -> list[Score]:
        if not rollouts:
            return []
        model, why = self._model()
        if not model:
            with self.lock:
                self.failures += len(rollouts)
            return [Score(None, why, extra={"judge/malformed": 0.0, "judge/attempts": 0.0})] * len(rollouts)
        futures = [self.pool.submit(self._judge, model, r) for r in rollouts]
        return [f.result() for f in futures]

    def _model(self) -> tuple[str, str]:
        """(the judge's model name, "") or ("", why not): `model`, else the first one `{url}/models`
        lists, asked until an answer names one."""
        import httpx

        with self.lock:
            if self.model:
                return self.model, ""
            where = f"judge {self.url}/models"
            try:
                resp = self.client.get(f"{self.url}/models")
                resp.raise_for_status()
                ids = [m["id"] for m in resp.json()["data"]]
            except httpx.HTTPStatusError as e:
                return "", f"{where} answered HTTP {e.response.status_code}: {e.response.text[:200]}"
            except httpx.HTTPError as e:
                return "", f"{where} unreachable ({type(e).__name__}: {e}); set scorer.judge_model to skip asking"
            except (ValueError, KeyError, TypeError) as e:
                return "", f"{where} answered without a model list ({type(e).__name__}: {e})"
            if not ids or not isinstance(ids[0], str) or not ids[0]:
                return "", f"{where} lists no model; set scorer.judge_model"
            self.model = ids[0]
            return self.model, ""

    def _judge(self, model: str, rollout: Rollout) -> Score:
        """One sample's grade: its request, tried `retries` times; a failure with the last reason."""

        if rollout.label is None and "label" in self.fields:
            with self.lock:
                self.failures += 1
            return Score(None, "the judge's template asks for {label} but the sample has none",
                         extra={"judge/malformed": 0.0, "judge/attempts": 0.0})
        body = {"model": model, "messages": [{"role": "user", "content": self.render(rollout)}],
                "max_tokens": self.max_tokens, "temperature": self.temperature}
        last, malformed, attempts = "", 0, 0
        for attempt in range(self.retries):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            attempts += 1
            with self.lock:
                self.calls += 1
            # (429, rate limited, is worth another attempt; any other 4xx is not)
            resp, last, again = http_attempt(self.client, f"{self.url}/chat/completions", body, self.timeout_s, (429,))
            if resp is None:
                if not again:
                    break
                continue
            text = answer_text(resp)
            value = None if text is None else parse_score(text, self.max_score)
            if value is None:
                malformed += 1
                with self.lock:
                    self.malformed += 1
                last = (f"answered without a chat completion: {quote(resp.text)}" if text is None else
                        f"answered without a score in [0, {self.max_score:g}]: {quote(text)}")
                continue
            return Score(value / self.max_score, extra={"judge/malformed": float(malformed > 0),
                                                        "judge/attempts": float(attempts)})
        with self.lock:
            self.failures += 1
        return Score(None, f"judge {self.url} failed after {attempts} attempt(s): {last}",
                     extra={"judge/malformed": float(malformed > 0), "judge/attempts": float(attempts)})


def answer_text(resp) -> str | None:
    """The text of a chat completion's first choice; None if the answer is not one."""
    try:
        content = resp.json()["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    if isinstance(content, list):  # content parts, as some servers answer
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else None
