"""Reward files get the dataset row whole (its other columns as keyword arguments), their options,
and the built-ins by name (actors/reward_files.py, actors/verifiers/__init__.py).

Real worker processes (spawned, as the scorer runs them)."""

from __future__ import annotations

import json

import pytest

from actors.reward_files import RewardFn, column_kwargs
from actors.verifiers import BUILTINS, builtin_names, resolve
from tests.helpers.scoring import make_rollout


def rollouts_with_columns():
    rows = [{"tests": ["assert f(1) == 2"], "difficulty": 3}, {"difficulty": 1, "source": "gsm8k"}, None]
    out = []
    for i, row in enumerate(rows):
        r = make_rollout(f"p{i}", f"c{i}", str(i), sample_index=i)
        r.columns = json.dumps(row) if row else ""
        out.append(r)
    return out


def test_columns_become_one_list_per_column_with_none_where_a_row_lacks_it():
    cols = [json.dumps({"a": 1, "b": [1, 2]}), "", json.dumps({"a": 2, "labels": "x"})]
    assert column_kwargs(cols, None, ("prompts", "completions", "labels")) == {"a": [1, None, 2],
                                                                            "b": [[1, 2], None, None]}
    assert column_kwargs(cols, {"b"}, ("prompts", "completions", "labels")) == {"b": [[1, 2], None, None]}
    assert column_kwargs(["", ""], None, ()) == {}


@pytest.mark.parametrize("signature, expect", [
    # the columns it names (a default for rows without them), all of them with **kwargs, none if neither
    ("def reward_fn(prompts, completions, labels, difficulty=None):\n    return [float(d or 0) for d in difficulty]",
     [3.0, 1.0, 0.0]),
    ("def reward_fn(prompts, completions, labels, **row):\n"
     "    return [float(len([k for k in row if row[k][i] is not None])) for i in range(len(prompts))]",
     [2.0, 2.0, 0.0]),
    ("def reward_fn(prompts, completions, labels):\n    return [1.0] * len(prompts)", [1.0, 1.0, 1.0]),
    ("def reward_func(queries, prompts, labels, **kwargs):\n"
     "    return {'rewards': [float(s == 'gsm8k') for s in kwargs['source']]}", [0.0, 1.0, 0.0]),
])
def test_a_reward_file_gets_the_rows_other_columns(tmp_path, signature, expect):
    path = tmp_path / "reward.py"
    path.write_text(signature + "\n")
    fn = RewardFn(str(path), timeout_s=30)
    try:
        assert [s.value for s in fn.score(rollouts_with_columns())] == expect
    finally:
        fn.close()


def test_options_reach_configure_and_a_file_without_configure_refuses_them(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text("SCALE = 1.0\n\ndef configure(options):\n    global SCALE\n    SCALE = options.get('scale', 1.0)\n"
                    "\ndef reward_fn(prompts, completions, labels):\n    return [SCALE] * len(prompts)\n")
    fn = RewardFn(str(path), timeout_s=30, options={"scale": 2.5})
    try:
        assert [s.value for s in fn.score(rollouts_with_columns()[:1])] == [2.5]
    finally:
        fn.close()
    plain = tmp_path / "plain.py"
    plain.write_text("def reward_fn(prompts, completions, labels):\n    return [1.0] * len(prompts)\n")
    with pytest.raises(ImportError, match=r"options \['scale'\] given, but the file defines no configure"):
        RewardFn(str(plain), timeout_s=30, options={"scale": 2.5})
    bad = tmp_path / "bad.py"  # a configure that refuses its options fails the start with its message
    bad.write_text("def configure(options):\n    raise ValueError(f'unknown options {sorted(options)}')\n"
                   "\ndef reward_fn(prompts, completions, labels):\n    return [1.0] * len(prompts)\n")
    with pytest.raises(ImportError, match=r"unknown options \['nope'\]"):
        RewardFn(str(bad), timeout_s=30, options={"nope": 1})


def test_a_builtin_is_named_and_an_unknown_name_lists_them(tmp_path):
    assert resolve("math") == str(BUILTINS / "math.py") and {"math", "format", "code"} <= set(builtin_names())
    assert resolve(str(tmp_path / "mine.py")) == str(tmp_path / "mine.py")  # a path stays a path
    with pytest.raises(ValueError, match=r"'maths' is neither a file nor a built-in reward \(code, format, math"):
        resolve("maths")
    from actors.config import ScorerConfig
    from common.config import ConfigError

    with pytest.raises(ConfigError, match="neither a file nor a built-in"):
        ScorerConfig(reward_fn="maths").validate()
