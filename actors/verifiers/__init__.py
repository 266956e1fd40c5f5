"""Built-in rewards: verifiers people train with, each a reward file the scorer runs like a user's.

`scorer.reward_fn: math` (a name without `/` or `.py`) is `actors/verifiers/math.py`; its options
come from `scorer.reward_fn_options` (a dict handed to the file's `configure(options)` once, when
the worker imports it). Each file defines

    reward_fn(prompts, completions, labels, **columns) -> list[float] | {"rewards", "scores"?, "extra_logs"?}

where `columns` are the dataset row's other columns (lists, one value per sample; a column a row
lacks is None there), and runs in the scorer's reward-function worker process: a call past
`scorer.reward_fn_timeout_s` fails that call's samples, never the scorer (actors/reward_files.py).

- `math`: the final answer (`\\boxed{}`, "the answer is", the last number) against the label,
  symbolically (math-verify);
- `format`: think/answer tags;
- `code`: the completion's program against the row's tests, in the sandbox (actors/tools/sandbox.py).
"""

from pathlib import Path

BUILTINS = Path(__file__).resolve().parent  # scorer.reward_fn: NAME -> BUILTINS / NAME.py


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTINS.glob("*.py") if not p.stem.startswith("_"))


def resolve(value: str) -> str:
    """scorer.reward_fn's file: a path as it is, a built-in's name as its file (ValueError for a
    name that is neither a file nor a built-in)."""
    if "/" in value or value.endswith(".py") or Path(value).is_file():
        return value
    if (BUILTINS / f"{value}.py").is_file():
        return str(BUILTINS / f"{value}.py")
    raise ValueError(f"scorer.reward_fn={value!r} is neither a file nor a built-in reward "
                     f"({', '.join(builtin_names())})")
