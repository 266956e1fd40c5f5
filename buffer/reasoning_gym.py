"""Prompt rows made on the spot by reasoning-gym's procedural generators, named like a dataset.

    reasoning_gym:chain_sum                                 1000 rows of chain_sum, seed 0
    reasoning_gym:chain_sum?size=200&seed=3&max_terms=4      a config field of the task's generator
    reasoning_gym:chain_sum+gcd+spell_backward?size=100     100 rows of each task, interleaved

stands wherever a prompt dataset does (`buffer.prompts`, `eval.dataset`). A spec's parameters are
`size` (rows per task), `seed` and, with one task only, the fields of that task's config dataclass
(`min_terms`, `max_terms`, ...), read as an int, a float or a bool where they look like one
(`true`/`false`), else as text (`%2C` writes a comma, which would otherwise split the list of
datasets). Several tasks share size and seed and take their defaults; their rows are interleaved
(row 0 of each task in turn, then row 1, ...), so a mix stays even when it is cut short.

Each row is

    prompt     the entry's question
    label      its answer as text (None for tasks that have no single answer: they score from metadata)
    task       the task's name (what `scorer.task_key: task` routes on)
    rg_task    the same, for the `reasoning_gym` reward
    rg_entry   the entry as JSON can hold it: {"question", "answer", "metadata"}
    rg_source  where it came from: {"seed", "size", "index", "params"}

and the `reasoning_gym` reward (actors/verifiers/reasoning_gym.py) scores a completion with the
task's own `score_answer`. Some tasks score from their config (decimal_arithmetic's tolerance,
puzzle24's numbers) or from metadata JSON cannot hold as it is (arc_agi's tuples), hence
`rg_source`: the reward remakes the dataset and the exact entry from it (`make_dataset`).

The same spec gives the same rows in every process, except for the few generators whose output
follows Python's string hashing (set order: isomorphic_strings, knight_swap, list_functions,
polynomial_multiplication, ransom_note, word_ladder, as of reasoning-gym 0.1.25), which repeat only
under one PYTHONHASHSEED. reasoning-gym is imported only when a spec is read.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Any
from urllib.parse import unquote

SCHEME = "reasoning_gym:"
DEFAULT_SIZE = 1000
DEFAULT_SEED = 0
UNLISTED = ("composite",)  # needs a list of datasets and weights: write tasks joined by `+` instead

_INT = re.compile(r"[-+]?\d+")
_FLOAT = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def is_reasoning_gym(path: str) -> bool:
    """Is `path` a reasoning-gym spec rather than a file or folder?"""
    return path.strip().startswith(SCHEME)


def task_names() -> list[str]:
    """The tasks a spec may name: reasoning-gym's registered datasets (`reasoning_gym.factory.DATASETS`)."""
    from reasoning_gym.factory import DATASETS

    return sorted(name for name in DATASETS if name not in UNLISTED)


def parse_spec(spec: str) -> tuple[list[str], int, int, dict[str, Any]]:
    """(tasks, size, seed, params) of `reasoning_gym:<task>[+<task>...][?size=N&seed=S&<param>=<value>...]`;
    ValueError naming what is wrong (an unknown task with the close names, an unknown param with the
    task's config fields)."""
    text = spec.strip()
    if not text.startswith(SCHEME):
        raise ValueError(f"{spec!r} is not a reasoning-gym spec (it starts with {SCHEME!r})")
    head, _, query = text[len(SCHEME):].partition("?")
    tasks = [t.strip() for t in head.split("+")]
    if not head.strip() or not all(tasks):
        raise ValueError(f"{spec!r}: name the tasks, e.g. '{SCHEME}chain_sum' or '{SCHEME}chain_sum+gcd'")
    twice = sorted({t for t in tasks if tasks.count(t) > 1})
    if twice:
        raise ValueError(f"{spec!r}: tasks {twice} are named more than once")
    known = task_names()
    for task in tasks:
        if task not in known:
            close = difflib.get_close_matches(task, known, n=5, cutoff=0.5)
            hint = f"close names: {', '.join(close)}; " if close else ""
            raise ValueError(f"{spec!r}: reasoning-gym has no task {task!r} ({hint}all {len(known)} are listed by "
                             f"`python -c \"from buffer.reasoning_gym import task_names; print(task_names())\"`)")
    values: dict[str, Any] = {}
    for part in query.split("&") if query else []:
        key, eq, raw = part.partition("=")
        key = unquote(key.strip())
        if not key or not eq or not raw.strip():
            raise ValueError(f"{spec!r}: {part!r} is not <param>=<value>")
        if key in values:
            raise ValueError(f"{spec!r}: {key!r} is given twice")
        values[key] = _value(unquote(raw.strip()))
    size, seed = values.pop("size", DEFAULT_SIZE), values.pop("seed", DEFAULT_SEED)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{spec!r}: size={size!r} must be a whole number >= 1 (rows per task)")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{spec!r}: seed={seed!r} must be a whole number")
    if values and len(tasks) > 1:
        raise ValueError(f"{spec!r}: params {sorted(values)} apply to one task only; with several tasks "
                         f"(`+`) give size and seed alone, or list each task as a dataset of its own")
    if values:
        fields = config_fields(tasks[0])
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ValueError(f"{spec!r}: {tasks[0]} has no params {unknown} (its config's: {', '.join(fields)})")
    return tasks, size, seed, values


def config_fields(task: str) -> list[str]:
    """The params a spec may set for `task`: its config dataclass's fields but size and seed."""
    from dataclasses import fields

    from reasoning_gym.factory import DATASETS

    return [f.name for f in fields(DATASETS[task][1]) if f.name not in ("size", "seed")]


def _value(raw: str) -> Any:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    if _INT.fullmatch(raw):
        return int(raw)
    if _FLOAT.fullmatch(raw):
        return float(raw)
    return raw


def make_dataset(task: str, seed: int, size: int, params: dict[str, Any] | None = None):
    """reasoning-gym's dataset `task` of `size` entries from `seed` with config `params`; ValueError
    quoting them when the config refuses them."""
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **(params or {}))
    except (AssertionError, TypeError, ValueError) as e:  # the config's validate() asserts
        raise ValueError(f"reasoning-gym {task} with size={size}, seed={seed}, params {params or {}}: "
                         f"{type(e).__name__}: {e}") from None


def json_safe(x: Any) -> Any:
    """`x` as JSON holds it: tuples and sets as lists (sets sorted when they can be), keys as text,
    arrays and numpy numbers through `tolist`, anything else unknown as its str."""
    if isinstance(x, dict):
        return {k if isinstance(k, str) else str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, (set, frozenset)):
        try:
            items = sorted(x)
        except TypeError:
            items = sorted(x, key=repr)
        return [json_safe(v) for v in items]
    if x is None or isinstance(x, (str, bool, int)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)  # NaN is not JSON
    if hasattr(x, "tolist"):
        return json_safe(x.tolist())
    return str(x)


def entry_json(entry: dict[str, Any]) -> dict[str, Any]:
    """A reasoning-gym entry as a row carries it: its question, answer and metadata, JSON-safe."""
    return json_safe({"question": entry["question"], "answer": entry["answer"], "metadata": entry.get("metadata", {})})


def reasoning_gym_rows(spec: str) -> list[dict[str, Any]]:
    """The prompt rows of `spec` (see the module docstring); the same spec gives the same rows."""
    tasks, size, seed, params = parse_spec(spec)
    datasets = [make_dataset(task, seed, size, params) for task in tasks]
    rows = []
    for index in range(size):
        for task, ds in zip(tasks, datasets):
            entry = ds[index]
            answer = entry["answer"]
            rows.append({
                "prompt": entry["question"],
                "label": None if answer is None else str(answer),
                "task": task,
                "rg_task": task,
                "rg_entry": entry_json(entry),
                "rg_source": {"seed": seed, "size": size, "index": index, "params": dict(params)},
            })
    return rows
