"""The `reasoning_gym` built-in reward: each completion scored by its task's own `score_answer`.

For prompt rows of a `reasoning_gym:` dataset (buffer/reasoning_gym.py), whose columns `rg_task`,
`rg_entry` and `rg_source` reach `reward_fn` as keyword arguments. The answer is taken from the
completion by the first extraction mode that finds one (`extract`, in order; `extract_answer`):

    answer_tag   what the last <answer>...</answer> holds (reasoning-gym's own `extract_answer`, as
                 its system prompts ask for), stripped; an empty tag finds nothing
    last_line    the last line that is not blank, stripped
    whole        the whole completion, stripped

and handed with the entry to `score_answer` of the task's dataset, which gives a number in [0, 1]:
1 for a right answer, a task's partial credit otherwise (0.01 for an answer in the wrong form,
len(answer)/len(completion) for one that holds the answer among other text, ...), 0 for none.

Which entry and which dataset: with `rg_source` ({"seed", "size", "index", "params"}) the dataset
is made again with the config the row was made with (some tasks score from it: decimal_arithmetic's
tolerance, puzzle24's numbers) and the entry taken from it, exactly as generated (arc_agi compares
tuples that JSON turns into lists), when it is the row's entry (else, e.g. for a generator that
follows string hashing in another process, the row's `rg_entry` is scored). Without `rg_source` (rows
made elsewhere) `rg_entry` is scored by the task's dataset with its default config. Datasets and
entries are cached per worker.

A sample without `rg_task` and `rg_entry` is not a reasoning-gym row and cannot be judged: it raises
ValueError, so the sample fails with that reason (the scorer marks it failed and the buffer drops
its group and counts it) instead of a 0.0 the policy would learn from as if its answer were wrong;
the worker scores the call's other samples one by one. So does a task reasoning-gym does not have.
An error inside `score_answer` (some tasks raise on an answer they cannot parse) scores 0.0.

Extra logs: `rg/answered`, whether an answer was found at all. Options (`configure`, from
`scorer.reward_fn_options`): `extract`, a mode or a list of them (default [answer_tag, whole]).
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from typing import Any, Sequence

from reasoning_gym.utils import extract_answer as tagged_answer

from buffer.reasoning_gym import entry_json, make_dataset

MODES = ("answer_tag", "last_line", "whole")
DEFAULTS = {"extract": ["answer_tag", "whole"]}
DEFAULT_SEED = 0  # the dataset that scores a row without rg_source (its entries are never used)

_settings = dict(DEFAULTS)  # what `configure` last set


def configure(options: dict) -> None:
    """Set this file's options (see the module docstring); a key not given takes its default."""
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"scorer.reward_fn_options: unknown keys {unknown} for `reasoning_gym` "
                         f"(allowed: {sorted(DEFAULTS)})")
    modes = options.get("extract", DEFAULTS["extract"])
    if isinstance(modes, str):
        modes = [modes]
    if not isinstance(modes, (list, tuple)) or not modes:
        raise ValueError(f"scorer.reward_fn_options.extract={modes!r}: expected a mode or a non-empty list of "
                         f"{list(MODES)}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"scorer.reward_fn_options.extract: unknown modes {bad} (allowed: {list(MODES)})")
    _settings.update(extract=list(modes))


def answer_tag(text: str) -> str | None:
    """What the last <answer>...</answer> holds, stripped; None if there is none or it is empty."""
    return tagged_answer(text) or None


def last_line(text: str) -> str | None:
    """The last line that is not blank, stripped; None if every line is."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def whole(text: str) -> str | None:
    return text.strip() or None


EXTRACTORS = {"answer_tag": answer_tag, "last_line": last_line, "whole": whole}


def extract_answer(completion: str, modes: Sequence[str] = DEFAULTS["extract"]) -> str | None:
    """The completion's answer by the first of `modes` that finds one, else None."""
    for mode in modes:
        answer = EXTRACTORS[mode](completion)
        if answer is not None:
            return answer
    return None


@lru_cache(maxsize=64)
def _dataset(task: str, seed: int, size: int, params: str):
    return make_dataset(task, seed, size, json.loads(params))


@lru_cache(maxsize=4096)
def _entry(task: str, seed: int, size: int, params: str, index: int) -> tuple[dict, dict]:
    """Entry `index` as its dataset makes it, and as a row carries it."""
    entry = _dataset(task, seed, size, params)[index]
    return entry, entry_json(entry)


def scoring_pair(task: str, entry: dict[str, Any], source: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
    """(dataset, entry) to score a row's answer with: remade from `source` when it gives back the row's
    entry, else the row's `entry` with the task's default dataset (see the module docstring)."""
    if source:
        key = (task, source["seed"], source["size"], json.dumps(source.get("params") or {}, sort_keys=True))
        if 0 <= source["index"] < source["size"]:
            made, carried = _entry(*key, source["index"])
            if carried == entry:
                return _dataset(*key), made
        return _dataset(*key), entry
    return _dataset(task, DEFAULT_SEED, 1, "{}"), entry


def score(answer: str | None, task: str, entry: dict[str, Any], source: dict[str, Any] | None = None) -> float:
    """The task's `score_answer` of `answer` for `entry` (0.0 for no answer, or when it raises)."""
    if answer is None:
        return 0.0
    dataset, scored_entry = scoring_pair(task, entry, source)
    try:
        value = float(dataset.score_answer(answer, scored_entry))
    except Exception:  # reasoning-gym's scorers may raise on an answer they cannot parse
        return 0.0
    return value if math.isfinite(value) else 0.0


def _row(task: Any, entry: Any, source: Any) -> tuple[str, dict, dict | None]:
    """A sample's (task, entry, source), read and checked; ValueError for a row that is not reasoning-gym's."""
    if isinstance(entry, str):  # a dataset that stores the entry as JSON text
        entry = json.loads(entry)
    if not isinstance(task, str) or not isinstance(entry, dict) or "answer" not in entry:
        raise ValueError(f"not a reasoning-gym row: the `reasoning_gym` reward needs the columns rg_task (a task "
                         f"name) and rg_entry (an entry with its answer), got rg_task={task!r} and "
                         f"rg_entry of type {type(entry).__name__} (rows of a `reasoning_gym:` dataset have both)")
    if source is not None and not (isinstance(source, dict) and all(
            isinstance(source.get(k), int) and not isinstance(source.get(k), bool) for k in ("seed", "size", "index"))):
        raise ValueError(f"rg_source={source!r}: expected {{\"seed\", \"size\", \"index\", \"params\"}} "
                         f"with whole numbers, as a `reasoning_gym:` dataset's rows hold it")
    return task, entry, source


def reward_fn(prompts, completions, labels, rg_task=None, rg_entry=None, rg_source=None, **columns) -> dict:
    """Each completion's score by its task's `score_answer` (see the module docstring); `rg/answered`
    logs whether an answer was found."""
    n = len(completions)
    tasks, entries, sources = (list(c) if c is not None else [None] * n for c in (rg_task, rg_entry, rg_source))
    rewards, answered = [], []
    for completion, task, entry, source in zip(completions, tasks, entries, sources):
        task, entry, source = _row(task, entry, source)
        answer = extract_answer(completion or "", _settings["extract"])
        answered.append(0.0 if answer is None else 1.0)
        rewards.append(score(answer, task, entry, source))
    return {"rewards": rewards, "extra_logs": {"rg/answered": answered}}
