"""The `math` built-in reward: 1.0 when a completion's final answer is the label's answer, else 0.0.

Each completion's final answer is found by the first extraction mode that finds one (`extract`, in
order; `extract_answer`):

    boxed        what the last \\boxed{...} (or \\fbox{...}) holds, braces balanced
    answer_is    the text after the last "the answer is" ("the final answer is") or "answer:", to the
                 end of its line or sentence
    last_number  the last number: -12, 3.5, 3/4, 1,234 (read as 1234), 2e5

and is compared with the label symbolically (`equivalent`) by math-verify, the answer checker the
field's math RL recipes use: it parses LaTeX into sympy (\\frac, \\dfrac, \\sqrt, \\pi, \\infty),
knows sets, intervals and tuples, percentages, `x = 2` against `2`, and drops units and `\\text{}`
wrappers, then compares numerically (to 6 decimals), symbolically and structurally. sympy's own
parser misreads or rejects such answers ("1,000" as the tuple (1, 0); "\\frac{1}{2}", "5 cm" and
"[1,2)" as syntax errors), hence math-verify.

Limits: an answer that is not mathematics (a word, a name) is read as a product of its letters, so
anagrams may compare equal ("listen", "silent"); a decimal equals a value it matches to 6 decimals
(0.333333 is 1/3, 0.33 is not); "2e3" as a whole answer is read as 2000, not 2·e·3. Each parse and
each comparison may take at most `timeout_s` (math-verify's SIGALRM timeouts: whole seconds, and only
in the main thread, where the reward-function worker calls reward_fn; elsewhere the caller must bound
the time), and an answer that runs past it scores 0.0: sympy would spend minutes on `9^{9^{9}}`.

Options (`configure`, from `scorer.reward_fn_options`): `extract` (the modes, in order) and
`timeout_s`. Without `configure` the defaults apply. (A format reward is the `format` built-in,
weighted as a task or a component of its own.)
"""

from __future__ import annotations

import math
import re
import threading
from typing import Sequence

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

MODES = ("boxed", "answer_is", "last_number")
DEFAULTS = {"extract": list(MODES), "timeout_s": 5}

_settings = dict(DEFAULTS)  # what `configure` last set

_ANSWER_IS = re.compile(r"the\s+(?:final\s+)?answer\s+is:?|answer[ \t]*:", re.IGNORECASE)
_SENTENCE_END = re.compile(r"\.(?=\s|$)")  # not a decimal point
_NUM = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"
# A minus sign counts when it follows no word or closing bracket ("x = -3", not "10-3"); a number never
# starts inside another.
_NUMBER = re.compile(rf"(?<![\d.])(?:(?<![\w)\]}}])-)?(?:{_NUM})(?:/(?:{_NUM})|[eE][-+]?\d+)?")
_SCIENTIFIC = re.compile(r"([-+]?(?:\d+\.?\d*|\.\d+))[eE]([-+]?\d+)")
_MATH_DELIMITER = re.compile(r"(?<!\\)\$|\\\(|\\\[")
_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())


def configure(options: dict) -> None:
    """Set this file's options (see the module docstring); a key not given takes its default."""
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"scorer.reward_fn_options: unknown keys {unknown} for `math` (allowed: {sorted(DEFAULTS)})")
    settings = {**DEFAULTS, **options}
    modes = settings["extract"]
    if isinstance(modes, str) or not isinstance(modes, (list, tuple)) or not modes:
        raise ValueError(f"scorer.reward_fn_options.extract={modes!r}: expected a non-empty list of {list(MODES)}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"scorer.reward_fn_options.extract: unknown modes {bad} (allowed: {list(MODES)})")
    timeout_s = settings["timeout_s"]
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"scorer.reward_fn_options.timeout_s={timeout_s!r}: expected a number > 0")
    _settings.update(settings, extract=list(modes))


def boxed_answer(text: str) -> str | None:
    """What the last \\boxed{...} or \\fbox{...} in `text` holds; None if there is none or its braces
    never close (the completion was cut off)."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0 or text[start:i].strip() not in ("\\boxed", "\\fbox"):
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j].strip() or None
    return None


def answer_is_answer(text: str) -> str | None:
    """The text after the last "the answer is" or "answer:", to the end of its line or of its sentence
    (a period then a space: "$5$. I hope it is correct."), without markdown bold; None if there is
    nothing there."""
    matches = list(_ANSWER_IS.finditer(text))
    if not matches:
        return None
    line = text[matches[-1].end():].split("\n", 1)[0]
    answer = _SENTENCE_END.split(line, maxsplit=1)[0].strip().strip("*").strip()
    return answer or None


def last_number(text: str) -> str | None:
    """The last number in `text` (thousands separators removed), else None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


EXTRACTORS = {"boxed": boxed_answer, "answer_is": answer_is_answer, "last_number": last_number}


def extract_answer(completion: str, modes: Sequence[str] = MODES) -> str | None:
    """The completion's final answer by the first of `modes` that finds one, else None."""
    for mode in modes:
        answer = EXTRACTORS[mode](completion)
        if answer is not None:
            return answer
    return None


def _parsed(text: str, timeout_s: int | None) -> list:
    """math-verify's reading of an answer or a label: what it parses as LaTeX math, `$`s added unless
    the text has its own delimiters, plain scientific notation made LaTeX's."""
    text = " ".join(text.split())
    scientific = _SCIENTIFIC.fullmatch(text)
    if scientific:
        text = f"{scientific.group(1)}\\times 10^{{{scientific.group(2)}}}"
    if not _MATH_DELIMITER.search(text):
        text = f"${text}$"
    return parse(text, extraction_config=_EXTRACTION, parsing_timeout=timeout_s)


def equivalent(answer: str, label: str, timeout_s: float = DEFAULTS["timeout_s"]) -> bool:
    """Is `answer` the same mathematical answer as `label`? False when either does not parse, or runs
    past `timeout_s` (per parse and per comparison) being parsed or compared."""
    # SIGALRM takes whole seconds and only reaches the main thread; elsewhere math-verify cannot time out
    limit = max(1, math.ceil(timeout_s)) if threading.current_thread() is threading.main_thread() else None
    try:
        gold = _parsed(label, limit)
        given = _parsed(answer, limit)
        return bool(gold) and bool(given) and verify(gold, given, timeout_seconds=limit)
    except (Exception, TimeoutException):  # math-verify's timeout is a BaseException
        return False


def reward_fn(prompts, completions, labels, **columns) -> dict:
    """1.0 for each completion whose extracted answer is equivalent to its label, else 0.0 (and 0.0
    where the label is None); `math/extracted` logs whether an answer was found at all."""
    rewards, extracted = [], []
    for completion, label in zip(completions, labels):
        answer = extract_answer(completion or "", _settings["extract"])
        extracted.append(0.0 if answer is None else 1.0)
        right = answer is not None and label is not None and equivalent(answer, str(label), _settings["timeout_s"])
        rewards.append(1.0 if right else 0.0)
    return {"rewards": rewards, "extra_logs": {"math/extracted": extracted}}
