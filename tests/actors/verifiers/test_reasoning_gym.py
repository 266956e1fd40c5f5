"""The `reasoning_gym` built-in reward (actors/verifiers/reasoning_gym.py): answer extraction, options,
right, wrong and partly right answers of several tasks, the row's config and exact entry reaching
`score_answer`, rows that are not reasoning-gym's, and the file run by the real reward-function worker."""

from __future__ import annotations

import json
import re
from decimal import Decimal

import pytest

from actors.reward_files import RewardFn
from actors.verifiers import reasoning_gym as rg_reward
from actors.verifiers.reasoning_gym import configure, extract_answer, reward_fn, score, scoring_pair
from buffer.reasoning_gym import reasoning_gym_rows
from tests.helpers.scoring import make_rollout


@pytest.fixture(autouse=True)
def default_options():
    configure({})
    yield
    configure({})


def rows(spec: str) -> list[dict]:
    """The spec's rows as the reward function gets them: through JSON."""
    return json.loads(json.dumps(reasoning_gym_rows(spec)))


def call(rows_: list[dict], completions: list[str], with_source: bool = True) -> dict:
    return reward_fn([r["prompt"] for r in rows_], completions, [r["label"] for r in rows_],
                     rg_task=[r["rg_task"] for r in rows_], rg_entry=[r["rg_entry"] for r in rows_],
                     rg_source=[r["rg_source"] for r in rows_] if with_source else None,
                     task=[r["task"] for r in rows_])


@pytest.mark.parametrize("completion,modes,answer", [
    ("<think>2+2</think>\n<answer> 4 </answer>", ["answer_tag"], "4"),
    ("<answer>3</answer> no, wait: <answer>4</answer>", ["answer_tag"], "4"),  # the last tag
    ("<answer>a\nb</answer>", ["answer_tag"], "a\nb"),
    ("<answer>  </answer>", ["answer_tag"], None),  # an empty tag finds nothing
    ("the answer is 4", ["answer_tag"], None),
    ("work\n\n  so: 4  \n\n", ["last_line"], "so: 4"),
    ("\n  \n", ["last_line"], None),
    ("  so 4 \n", ["whole"], "so 4"),
    ("", ["whole"], None),
    ("<answer>7</answer> then more", ["answer_tag", "whole"], "7"),  # the default order
    ("just 7\n", ["answer_tag", "whole"], "just 7"),
    ("<answer></answer>\nline 2", ["answer_tag", "last_line", "whole"], "line 2"),
])
def test_extract_answer(completion, modes, answer):
    assert extract_answer(completion, modes) == answer


def test_extraction_follows_the_configured_modes():
    row = rows("reasoning_gym:chain_sum?size=1&seed=4")
    label = row[0]["label"]  # one number
    completion = f"<answer>{label}</answer>\n{label} is it"
    assert call(row, [completion])["rewards"] == [1.0]  # the tag
    configure({"extract": "last_line"})
    # the base score_answer: the answer within other text scores len(answer) / len(text)
    assert call(row, [completion])["rewards"] == [len(label) / len(f"{label} is it")]
    configure({"extract": ["whole"]})
    assert call(row, [f"  {label} \n"])["rewards"] == [1.0]


@pytest.mark.parametrize("options,message", [
    ({"mode": "whole"}, "unknown keys ['mode'] for `reasoning_gym` (allowed: ['extract'])"),
    ({"extract": []}, "extract=[]: expected a mode or a non-empty list"),
    ({"extract": 3}, "extract=3: expected a mode or a non-empty list"),
    ({"extract": ["answer_tag", "boxed"]}, "unknown modes ['boxed']"),
])
def test_configure_rejects_bad_options(options, message):
    with pytest.raises(ValueError) as e:
        configure(options)
    assert message in str(e.value)
    row = rows("reasoning_gym:gcd?size=1")
    assert call(row * 2, [f"<answer>{row[0]['label']}</answer>", f" {row[0]['label']}\n"])["rewards"] == [1.0, 1.0]


@pytest.mark.parametrize("task", ["chain_sum", "basic_arithmetic"])
def test_arithmetic_right_and_wrong(task):
    batch = rows(f"reasoning_gym:{task}?size=5&seed=11")
    right = [f"<think>...</think><answer>{r['label']}</answer>" for r in batch]
    wrong = [f"<answer>{int(r['label']) + 1}</answer>" for r in batch]  # never holds the right number
    chatty = [f"The result is {r['label']}" for r in batch]  # no tag: the whole text, which holds the answer
    assert call(batch, right) == {"rewards": [1.0] * 5, "extra_logs": {"rg/answered": [1.0] * 5}}
    assert call(batch, wrong)["rewards"] == [0.0] * 5
    assert call(batch, chatty)["rewards"] == [len(r["label"]) / len(c) for r, c in zip(batch, chatty)]
    assert call(batch, [""] * 5) == {"rewards": [0.0] * 5, "extra_logs": {"rg/answered": [0.0] * 5}}


def test_knights_and_knaves_right_in_any_order_and_partly_right():
    row = rows("reasoning_gym:knights_knaves?size=1&seed=2&n_people=2")
    label = row[0]["label"]  # "Riley is an altruist, and Daniel is an egoist."
    (a, role_a), (b, role_b) = re.findall(r"(\w+) is an? (\w+)", label)
    good, bad = re.search(r"is a (\w+)/(\w+)", row[0]["prompt"]).groups()  # the task's two roles
    other = {good: bad, bad: good}
    completions = [f"<answer>{label}</answer>",
                   f"<answer>{b} is a {role_b}, and {a} is a {role_a}</answer>",
                   f"<answer>{a} is a {role_a}, and {b} is a {other[role_b]}</answer>"]
    # knights_knaves compares the (name, role) pairs: all of them, in any order, 1.0; 1 of 2 gives 0.3 + 0.7 / 2
    assert call(row * 3, completions)["rewards"] == pytest.approx([1.0, 1.0, 0.65])


def test_spell_backward_scores_the_matching_letters():
    row = rows("reasoning_gym:spell_backward?size=1&seed=3")
    word = row[0]["label"]
    last_wrong = word[:-1] + ("x" if word[-1] != "x" else "y")
    # letters right at their place, over the word's length: all but the last
    assert call(row * 3, [f"<answer>{word}</answer>", f"<answer>{last_wrong}</answer>", "<answer>?</answer>"]
                )["rewards"] == pytest.approx([1.0, (len(word) - 1) / len(word), 0.0])


def test_the_rows_config_reaches_score_answer():
    # decimal_arithmetic's tolerance is one unit of its config's last decimal place: 0.1 here, 0.001 by default
    row = rows("reasoning_gym:decimal_arithmetic?size=1&seed=4&min_num_decimal_places=1&max_num_decimal_places=1")
    near = str(Decimal(row[0]["label"]) + Decimal("0.05"))
    assert call(row, [f"<answer>{near}</answer>"])["rewards"] == [1.0]
    assert call(row, [f"<answer>{near}</answer>"], with_source=False)["rewards"] == [0.0]  # the default config's


def test_the_exact_entry_is_scored_where_json_changed_it():
    # arc_agi compares the parsed answer with metadata["output"], tuples of tuples that JSON makes lists
    row = rows("reasoning_gym:arc_agi?size=1&seed=1")
    right = f"<answer>{row[0]['label']}</answer>"
    assert call(row, [right])["rewards"] == [1.0]
    assert call(row, [right], with_source=False)["rewards"] == [0.05]  # arc_agi's "a board, not the one"


def test_a_row_whose_entry_cannot_be_remade_is_scored_from_its_own_entry():
    row = rows("reasoning_gym:chain_sum?size=1&seed=4")[0]
    changed = {**row["rg_entry"], "question": "1 + 2 =", "answer": "3"}  # not what its source makes
    assert score("3", "chain_sum", changed, row["rg_source"]) == 1.0
    assert scoring_pair("chain_sum", changed, row["rg_source"])[1] is changed
    outside = {**row["rg_source"], "index": 5}  # past the source's size
    assert score(row["label"], "chain_sum", row["rg_entry"], outside) == 1.0


def test_an_answer_score_answer_chokes_on_scores_zero():
    row = rows("reasoning_gym:prime_factorization?size=1&seed=4")
    dataset, entry = scoring_pair("prime_factorization", row[0]["rg_entry"], row[0]["rg_source"])
    with pytest.raises(ValueError):
        dataset.score_answer("no idea", entry)
    assert call(row * 2, ["<answer>no idea</answer>", f"<answer>{row[0]['label']}</answer>"])["rewards"] == [0.0, 1.0]


def test_an_entry_stored_as_json_text_is_read():
    row = rows("reasoning_gym:gcd?size=1&seed=4")[0]
    out = reward_fn(["q"], [f"<answer>{row['label']}</answer>"], [row["label"]], rg_task=["gcd"],
                    rg_entry=[json.dumps(row["rg_entry"])])
    assert out["rewards"] == [1.0]


@pytest.mark.parametrize("columns,message", [
    ({}, "not a reasoning-gym row: the `reasoning_gym` reward needs the columns rg_task"),
    ({"rg_task": ["gcd"]}, "rg_entry of type NoneType"),
    ({"rg_task": [None], "rg_entry": [{"answer": "1"}]}, "got rg_task=None"),
    ({"rg_task": ["gcd"], "rg_entry": [{"answer": "1"}], "rg_source": [{"seed": 0}]}, "rg_source={'seed': 0}"),
    ({"rg_task": ["no_such_task"], "rg_entry": [{"answer": "1"}]}, "Dataset 'no_such_task' not registered"),
])
def test_a_row_that_is_not_reasoning_gyms_fails(columns, message):
    with pytest.raises(ValueError) as e:
        reward_fn(["q"], ["<answer>1</answer>"], ["1"], **columns)
    assert message in str(e.value)


def rollout(row: dict | None, completion: str, i: int):
    r = make_rollout(row["prompt"] if row else "q", completion, row["label"] if row else "1", sample_index=i)
    if row is not None:
        r.columns = json.dumps({k: row[k] for k in ("task", "rg_task", "rg_entry", "rg_source")})
    return r


def test_the_worker_scores_completions():
    batch = rows("reasoning_gym:chain_sum+knights_knaves+arc_agi?size=1&seed=6")
    fn = RewardFn(rg_reward.__file__, timeout_s=60)
    try:
        out = fn.score([rollout(batch[0], f"<answer>{batch[0]['label']}</answer>", 0),
                        rollout(batch[1], f"<answer>{batch[1]['label']}</answer>", 1),
                        rollout(batch[2], f"<answer>{batch[2]['label']}</answer>", 2),
                        rollout(batch[0], "<answer>no</answer>", 3),
                        rollout(None, "<answer>1</answer>", 4)])  # a row without the columns
        assert [s.value for s in out] == [1.0, 1.0, 1.0, 0.0, None]
        assert [s.extra for s in out[:4]] == [{"rg/answered": 1.0}] * 4
        assert "not a reasoning-gym row" in out[4].error
    finally:
        fn.close()


def test_the_worker_takes_options():
    batch = rows("reasoning_gym:basic_arithmetic?size=2&seed=6")
    fn = RewardFn("reasoning_gym", timeout_s=60, options={"extract": ["last_line"]})
    try:
        out = fn.score([rollout(batch[0], f"work...\n{batch[0]['label']}\n", 0),
                        rollout(batch[1], f"<answer>{batch[1]['label']}</answer>\nthanks", 1)])
        assert [s.value for s in out] == [1.0, 0.0]
    finally:
        fn.close()
    with pytest.raises(ImportError) as e:
        RewardFn("reasoning_gym", timeout_s=60, options={"extract": ["boxed"]})
    assert "unknown modes ['boxed']" in str(e.value)
