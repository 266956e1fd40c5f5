"""The answer helpers OpenRLHF 0.11 exports from `openrlhf.utils` (its `math_utils`), written for the
stand-in module OpenRLHF reward files import (actors/envs/openrlhf_agent.py `openrlhf_standin`).

- `extract_boxed_answer(text)`: what the last `\\boxed{...}` (braces balanced) holds, else None.
- `grade_answer(given, truth)`: True when the two are the same answer: equal once normalised (spaces,
  `\\left`/`\\right`, `\\dfrac`, `$`, `\\%`, degrees, a trailing `\\text{ unit}`, a `x =` prefix, a
  leading `\\text{...}` wrapper, thousands commas), equal as numbers, or, for short expressions with
  at most two unknowns, equal under sympy (their difference simplifies to 0, within a time limit).
  Tuples and intervals compare element by element with the same brackets. None on either side: False.

Both are pure functions of their text; sympy is imported on the first comparison that needs it.
"""

from __future__ import annotations

import re
import signal
import threading

SYMPY_TIMEOUT_S = 5  # one sympy comparison at most (it can hang on adversarial input)
MAX_SYMPY_CHARS = 64  # longer expressions are compared as normalised text only


def extract_boxed_answer(solution: str | None) -> str | None:
    """The content of the last `\\boxed{...}` in `solution` (nested braces kept), else None."""
    if not solution:
        return None
    start = solution.rfind("\\boxed")
    if start < 0:
        return None
    i = start + len("\\boxed")
    while i < len(solution) and solution[i] == " ":
        i += 1
    if i >= len(solution) or solution[i] != "{":
        return None
    depth = 0
    for j in range(i, len(solution)):
        depth += {"{": 1, "}": -1}.get(solution[j], 0)
        if depth == 0:
            return solution[i + 1:j]
    return None  # unbalanced: the answer was cut off


def _strip_text_wrapper(s: str) -> str:
    m = re.fullmatch(r"\\text\{(.+?)\}", s)
    return m.group(1).strip() if m else s


def normalize_answer(answer: str) -> str:
    """The spelling of an answer that equal answers share (see the module docstring)."""
    s = _strip_text_wrapper(answer.strip())
    s = re.sub(r"\\text\{\s+[^}]*\}$", "", s)  # a trailing unit: "5 \text{ cm}"
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""), ("$", ""),
                     ("\\%", ""), ("%", ""), ("\\,", ""), ("\\;", ""), ("\\ ", "")):
        s = s.replace(old, new)
    s = s.replace(" ", "")
    if re.fullmatch(r"[a-zA-Z]{1,2}=.+", s):  # "x=5" -> "5"
        s = s.split("=", 1)[1]
    s = re.sub(r"(\d),(\d\d\d)(?!\d)", r"\1\2", s)  # 1,000 -> 1000
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12 -> \frac{1}{2}
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    if s.startswith("."):
        s = "0" + s
    if len(s) > 2 and s[0] == "{" and s[-1] == "}" and s.count("{") == 1:
        s = s[1:-1]
    return s


def _number(s: str) -> float | None:
    """s as a number: a decimal, an integer, a/b or \\frac{a}{b} of those; else None."""
    m = re.fullmatch(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s) or re.fullmatch(r"(-?)([\d.]+)/([\d.]+)", s)
    try:
        if m:
            value = float(m.group(2)) / float(m.group(3))
            return -value if m.group(1) else value
        return float(s)
    except (ValueError, ZeroDivisionError):
        return None


def _as_sympy_text(s: str) -> str:
    """A normalised LaTeX answer as text sympy's parser reads (the common constructs only)."""
    for _ in range(4):  # nested fractions and roots, innermost first
        s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
        s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    for old, new in (("\\cdot", "*"), ("\\times", "*"), ("\\pi", "pi"), ("^", "**"), ("{", "("), ("}", ")")):
        s = s.replace(old, new)
    return s


def _timeout(signum, frame):
    raise TimeoutError


def _equal_under_sympy(a: str, b: str) -> bool:
    text = f"({_as_sympy_text(a)})-({_as_sympy_text(b)})"
    letters = {c for c in text.replace("sqrt", "").replace("pi", "") if c.isalpha()}
    if "\\" in text or len(letters) > 2 or len(text) > 2 * MAX_SYMPY_CHARS + 8:
        return False
    from sympy import simplify
    from sympy.parsing.sympy_parser import implicit_multiplication_application, parse_expr, standard_transformations

    on_main = threading.current_thread() is threading.main_thread()
    if on_main:  # SIGALRM only reaches the main thread; elsewhere the caller's own timeout applies
        previous = signal.signal(signal.SIGALRM, _timeout)
        signal.alarm(SYMPY_TIMEOUT_S)
    try:
        diff = parse_expr(text, transformations=standard_transformations + (implicit_multiplication_application,))
        return simplify(diff) == 0
    except Exception:  # a parse error, a timeout, anything sympy raises: not shown equal
        return False
    finally:
        if on_main:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)


def _split_tuple(s: str) -> tuple[str, list[str]]:
    """('()', ['1', '2']) for "(1,2)"; ('', [s]) for anything that is not a bracketed list."""
    if len(s) > 2 and s[0] in "([" and s[-1] in ")]" and not any(c in s[1:-1] for c in "()[]"):
        return s[0] + s[-1], [e for e in s[1:-1].split(",")]
    return "", [s]


def _same_element(a: str, b: str) -> bool:
    if a == b:
        return True
    x, y = _number(a), _number(b)
    if x is not None and y is not None:
        return abs(x - y) <= 1e-6 * max(1.0, abs(x), abs(y))
    return max(len(a), len(b)) <= MAX_SYMPY_CHARS and _equal_under_sympy(a, b)


def grade_answer(given_answer: str | None, ground_truth: str | None) -> bool:
    """Is `given_answer` (already taken out of its \\boxed{}) the same answer as `ground_truth`?"""
    if given_answer is None or ground_truth is None:
        return False
    given, truth = normalize_answer(str(given_answer)), normalize_answer(str(ground_truth))
    if not given or not truth:
        return given == truth
    if given == truth:
        return True
    (given_brackets, given_elems), (truth_brackets, truth_elems) = _split_tuple(given), _split_tuple(truth)
    if given_brackets != truth_brackets or len(given_elems) != len(truth_elems):
        return False
    return all(_same_element(a, b) for a, b in zip(given_elems, truth_elems))


def get_tokenizer(pretrain: str, model=None, padding_side: str = "left", strategy=None, use_fast: bool = True):
    """OpenRLHF's `get_tokenizer`: the folder's tokenizer, padded on `padding_side`, eos as pad when it
    has none (and `model`'s config told which id pads)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pretrain, trust_remote_code=True, use_fast=use_fast)
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
        if model is not None:
            model.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer
