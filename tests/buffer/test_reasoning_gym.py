"""Prompt rows from reasoning-gym specs (buffer/reasoning_gym.py): reading a spec and refusing bad ones,
rows that repeat for the same spec (in another process too) and that JSON and the buffer's column
encoder take as they are."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import reasoning_gym

from buffer.prompts import MAX_COLUMNS_BYTES, other_columns
from buffer.reasoning_gym import (
    DEFAULT_SEED,
    DEFAULT_SIZE,
    SCHEME,
    config_fields,
    is_reasoning_gym,
    json_safe,
    parse_spec,
    reasoning_gym_rows,
    task_names,
)

ROOT = Path(__file__).resolve().parents[2]


def test_is_reasoning_gym_tells_specs_from_paths():
    assert SCHEME == "reasoning_gym:"
    assert is_reasoning_gym("reasoning_gym:chain_sum") and is_reasoning_gym("  reasoning_gym:gcd?size=3")
    assert not is_reasoning_gym("data/train.jsonl") and not is_reasoning_gym("reasoning_gym/chain_sum.jsonl")


@pytest.mark.parametrize("spec,parsed", [
    ("reasoning_gym:chain_sum", (["chain_sum"], DEFAULT_SIZE, DEFAULT_SEED, {})),
    ("reasoning_gym:chain_sum+gcd?size=10&seed=-3", (["chain_sum", "gcd"], 10, -3, {})),
    # values typed as they look: int, bool (any case), float, text (%xx unquoted, `+` kept)
    ("reasoning_gym:chain_sum?max_terms=4&allow_negation=TRUE", (["chain_sum"], 1000, 0,
                                                                 {"max_terms": 4, "allow_negation": True})),
    ("reasoning_gym:basic_arithmetic?size=5&format_style=natural&whitespace=%20",
     (["basic_arithmetic"], 5, 0, {"format_style": "natural", "whitespace": " "})),
    ("reasoning_gym:advanced_geometry?min_coord=-1.5&max_coord=2e1",
     (["advanced_geometry"], 1000, 0, {"min_coord": -1.5, "max_coord": 20.0})),
    (" reasoning_gym: chain_sum + gcd ?seed=2", (["chain_sum", "gcd"], 1000, 2, {})),
])
def test_parse_spec(spec, parsed):
    assert parse_spec(spec) == parsed


@pytest.mark.parametrize("spec,message", [
    ("data.jsonl", "is not a reasoning-gym spec"),
    ("reasoning_gym:", "name the tasks"),
    ("reasoning_gym:chain_sum+", "name the tasks"),
    ("reasoning_gym:chain_sum+chain_sum", "tasks ['chain_sum'] are named more than once"),
    ("reasoning_gym:chain_sun", "no task 'chain_sun' (close names: chain_sum"),
    ("reasoning_gym:composite", "no task 'composite'"),  # a mix is written with `+`
    ("reasoning_gym:chain_sum+gcd?max_terms=3", "params ['max_terms'] apply to one task only"),
    ("reasoning_gym:chain_sum?foo=1", "chain_sum has no params ['foo'] (its config's: min_terms, max_terms"),
    ("reasoning_gym:chain_sum?size=0", "size=0 must be a whole number >= 1"),
    ("reasoning_gym:chain_sum?size=2.5", "size=2.5 must be a whole number"),
    ("reasoning_gym:chain_sum?seed=abc", "seed='abc' must be a whole number"),
    ("reasoning_gym:chain_sum?size=3&size=4", "'size' is given twice"),
    ("reasoning_gym:chain_sum?size", "'size' is not <param>=<value>"),
    ("reasoning_gym:chain_sum?seed=", "'seed=' is not <param>=<value>"),
])
def test_parse_spec_refuses_bad_specs(spec, message):
    with pytest.raises(ValueError) as e:
        parse_spec(spec)
    assert message in str(e.value)


def test_an_unknown_task_says_how_to_list_them_all():
    with pytest.raises(ValueError) as e:
        parse_spec("reasoning_gym:no_such_task_here")
    assert "close names" not in str(e.value) and f"all {len(task_names())} are listed by" in str(e.value)
    assert "task_names()" in str(e.value)
    assert "chain_sum" in task_names() and "composite" not in task_names()


def test_a_config_that_refuses_its_params_is_a_value_error():
    with pytest.raises(ValueError) as e:
        reasoning_gym_rows("reasoning_gym:chain_sum?size=2&min_terms=9")
    assert "chain_sum with size=2, seed=0, params {'min_terms': 9}: AssertionError" in str(e.value)
    assert "min_terms" in config_fields("chain_sum") and "size" not in config_fields("chain_sum")


def test_rows_are_reasoning_gyms_entries():
    rows = reasoning_gym_rows("reasoning_gym:chain_sum?size=3&seed=5&max_terms=3")
    ds = reasoning_gym.create_dataset("chain_sum", size=3, seed=5, max_terms=3)
    assert len(rows) == 3
    for i, row in enumerate(rows):
        entry = ds[i]
        assert row["prompt"] == entry["question"] and row["label"] == str(entry["answer"])
        assert row["task"] == row["rg_task"] == "chain_sum"
        assert row["rg_entry"] == json_safe({k: entry[k] for k in ("question", "answer", "metadata")})
        assert row["rg_source"] == {"seed": 5, "size": 3, "index": i, "params": {"max_terms": 3}}


def test_several_tasks_are_interleaved_with_size_rows_each():
    rows = reasoning_gym_rows("reasoning_gym:chain_sum+gcd+spell_backward?size=4&seed=1")
    assert [r["task"] for r in rows] == ["chain_sum", "gcd", "spell_backward"] * 4
    assert [r["rg_source"]["index"] for r in rows] == [i for i in range(4) for _ in range(3)]
    alone = reasoning_gym_rows("reasoning_gym:gcd?size=4&seed=1")
    assert [r for r in rows if r["task"] == "gcd"] == alone  # a task's rows do not depend on its company


def test_the_same_spec_gives_the_same_rows_and_another_seed_others():
    spec = "reasoning_gym:chain_sum+basic_arithmetic+knights_knaves?size=20&seed=7"
    first = reasoning_gym_rows(spec)
    assert reasoning_gym_rows(spec) == first
    assert json.dumps(reasoning_gym_rows(spec)) == json.dumps(first)
    other = reasoning_gym_rows(spec.replace("seed=7", "seed=8"))
    assert [r["prompt"] for r in other] != [r["prompt"] for r in first]


def test_the_same_spec_gives_the_same_rows_in_another_process():
    # another string hash seed too: these tasks' generators do not follow set order
    spec = "reasoning_gym:chain_sum+basic_arithmetic+knights_knaves+letter_counting?size=10&seed=3"
    code = ("import json; from buffer.reasoning_gym import reasoning_gym_rows; "
            f"print(json.dumps(reasoning_gym_rows({spec!r})))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert json.loads(out) == reasoning_gym_rows(spec)


def test_rows_are_json_safe_and_fit_the_buffers_columns():
    # arc_agi's metadata holds tuples of tuples, knights_knaves' and boxnet's nested structures
    rows = reasoning_gym_rows("reasoning_gym:arc_agi+knights_knaves+boxnet+propositional_logic?size=3")
    assert json.loads(json.dumps(rows, allow_nan=False)) == rows
    for row in rows:
        columns = json.loads(other_columns(row, ("prompt", "label"), None))
        assert set(columns) == {"task", "rg_task", "rg_entry", "rg_source"}
        assert len(json.dumps(columns).encode()) < MAX_COLUMNS_BYTES
    arc = rows[0]["rg_entry"]["metadata"]
    assert isinstance(arc["output"], list) and all(isinstance(r, list) for r in arc["output"])


def test_tasks_without_a_single_answer_have_no_label():
    rows = reasoning_gym_rows("reasoning_gym:propositional_logic?size=2")
    assert [r["label"] for r in rows] == [None, None]
    assert all(r["rg_entry"]["answer"] is None and r["rg_entry"]["metadata"] for r in rows)


def test_json_safe():
    value = {(1, 2): {3, 1, 2}, 4: (np.int64(5), np.arange(2)), "x": [Fraction(1, 3), math.nan, 1.5, None, True],
             "s": frozenset({"b", ("a", 1)})}
    assert json_safe(value) == {"(1, 2)": [1, 2, 3], "4": [5, [0, 1]], "x": ["1/3", "nan", 1.5, None, True],
                                "s": ["b", ["a", 1]]}  # a mixed set in the order of its items' repr
    json.dumps(json_safe(value), allow_nan=False)
