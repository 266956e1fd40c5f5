"""The `math` built-in reward (actors/verifiers/math.py): answer extraction, math-verify's equivalence on
the forms answers take, options, and the file run by the real reward-function worker, including an
answer that would keep sympy busy for minutes."""

from __future__ import annotations

import time

import pytest

from actors.reward_files import RewardFn
from actors.verifiers import math as math_reward
from actors.verifiers.math import configure, equivalent, extract_answer, reward_fn
from tests.helpers.scoring import make_rollout

# sympy evaluates this tower when comparing it with anything: without a time limit the comparison ran
# past 60 s (as did (10^{10})! and 9^{9^{9^{9^{9}}}}).
PATHOLOGICAL = "so the total is \\boxed{9^{9^{9}}}"


@pytest.fixture(autouse=True)
def default_options():
    configure({})
    yield
    configure({})


# (answer, label, same answer?) as math-verify judges them, each checked by hand to be right
EQUIVALENCE = [
    # fractions and their spellings
    ("\\frac{1}{2}", "0.5", True),
    ("1/2", "\\frac{1}{2}", True),
    ("\\dfrac{1}{2}", "1/2", True),
    ("\\frac12", "0.5", True),
    ("-\\frac{1}{2}", "-0.5", True),
    ("-1/2", "\\frac{-1}{2}", True),
    ("\\frac{1}{3}", "0.333333", True),  # equal to 6 decimals
    # roots and pi
    ("\\sqrt{2}/2", "\\frac{\\sqrt2}{2}", True),
    ("\\frac{1}{\\sqrt{3}}", "\\frac{\\sqrt{3}}{3}", True),
    ("2\\sqrt{2}", "\\sqrt{8}", True),
    ("\\pi/2", "\\frac{\\pi}{2}", True),
    ("1.57079632679", "\\frac{\\pi}{2}", True),
    # percentages, thousands separators, units, scientific notation
    ("50\\%", "0.5", True),
    ("1,234,567", "1234567", True),
    ("1{,}000", "1000", True),
    ("5 \\text{ cm}", "5", True),
    ("5 cm", "5", True),
    ("90^\\circ", "90", True),
    ("1.5e3", "1500", True),
    ("3\\times10^{8}", "300000000", True),
    ("10^{-3}", "0.001", True),
    # intervals, sets, equations, expressions
    ("(-\\infty, 3]", "(-\\infty,3]", True),
    ("\\{2,1\\}", "\\{1,2\\}", True),
    ("x = 2", "2", True),
    ("x^2+2x+1", "(x+1)^2", True),
    # wrong answers that look right
    ("1/2", "2", False),
    ("[1,2)", "[1,2]", False),
    ("(1,2)", "[1,2]", False),
    ("0.33", "1/3", False),
    ("x=2", "3", False),
    ("-3", "3", False),
    ("\\{1,2\\}", "\\{1,2,3\\}", False),
    ("3.14159", "\\pi", False),
    ("1.999999", "2", False),
    ("1e-3", "0.01", False),
    ("\\sqrt{2}", "2", False),
    ("y=2", "x=2", False),
]


@pytest.mark.parametrize("answer,label,same", EQUIVALENCE)
def test_equivalent(answer, label, same):
    assert equivalent(answer, label, timeout_s=5) is same


@pytest.mark.parametrize("answer,label,same", EQUIVALENCE)
def test_reward_fn_scores_a_boxed_answer_as_equivalent_does(answer, label, same):
    out = reward_fn(["q"], [f"Working... so the answer is \\boxed{{{answer}}}."], [label])
    assert out == {"rewards": [1.0 if same else 0.0], "extra_logs": {"math/extracted": [1.0]}}


@pytest.mark.parametrize("answer,label", [("", "5"), ("5", ""), ("\\frac{", "1"), ("}}}", "1")])
def test_equivalent_is_false_when_either_side_does_not_parse(answer, label):
    assert equivalent(answer, label, timeout_s=5) is False


def test_equivalent_gives_up_at_its_time_limit():
    t = time.monotonic()
    assert equivalent("9^{9^{9}}", "1", timeout_s=1) is False
    assert time.monotonic() - t < 10  # the 1 s alarm, not sympy's minutes


@pytest.mark.parametrize("completion,answer", [
    ("\\boxed{\\frac{1}{2}} at first, then \\boxed{3}", "3"),  # the last box
    ("so $\\boxed{\\frac{a}{\\sqrt{b}}}$", "\\frac{a}{\\sqrt{b}}"),  # nested braces kept
    ("\\fbox{7}", "7"),
    ("\\boxed {5}", "5"),
    ("The answer is $\\frac{1}{2}$.", "$\\frac{1}{2}$"),
    ("Final Answer: The final answer is $5$. I hope it is correct.", "$5$"),
    ("The answer is 3.5.", "3.5"),
    ("**Answer:** 42", "42"),
    ("answer: x = 2\nsome more text 9", "x = 2"),  # to the end of its line
    ("we get 1,234,567 apples", "1234567"),
    ("so x = -3", "-3"),
    ("10-3 makes 7 or 10-3", "3"),  # a minus between numbers is not a sign
    ("the ratio is 3/4.", "3/4"),
    ("about .5 or 2.25", "2.25"),
    ("no number here", None),
])
def test_extract_answer_with_the_default_modes(completion, answer):
    assert extract_answer(completion, math_reward.MODES) == answer


def test_extraction_modes_are_tried_in_order():
    completion = "The answer is 3.\nCheck: \\boxed{4}, from 5 tries"
    assert extract_answer(completion, ["boxed", "answer_is", "last_number"]) == "4"
    assert extract_answer(completion, ["answer_is", "boxed"]) == "3"
    assert extract_answer(completion, ["last_number", "boxed"]) == "5"
    # a mode that finds nothing hands over to the next
    assert extract_answer("so the answer is 3", ["boxed", "last_number"]) == "3"
    assert extract_answer("\\boxed{3} or \\boxed{4", ["boxed"]) is None  # the last box never closes
    assert extract_answer("so the answer is\n\n5", ["answer_is"]) is None  # nothing on its line


def test_reward_fn_per_sample():
    completions = ["so \\boxed{\\dfrac{1}{2}}", "The answer is 1,000.", "I think it is 7", "no idea",
                   "\\boxed{4}", "\\boxed{2}", ""]
    labels = ["0.5", "1000", "7", "3", None, "3", "1"]
    out = reward_fn(["q"] * 7, completions, labels)
    assert out["rewards"] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # a None label scores 0.0
    assert out["extra_logs"] == {"math/extracted": [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]}


def test_reward_fn_takes_the_rows_other_columns_and_non_text_labels():
    out = reward_fn(["q"], ["\\boxed{12}"], [12], source=["gsm8k"], difficulty=[None])
    assert out["rewards"] == [1.0]


def test_configure_sets_the_modes_and_restores_defaults():
    completion = "The answer is 3. Check: \\boxed{4}"
    assert reward_fn(["q"], [completion], ["3"])["rewards"] == [0.0]  # boxed first: 4
    configure({"extract": ["answer_is"], "timeout_s": 2})
    assert reward_fn(["q"], [completion], ["3"])["rewards"] == [1.0]
    configure({"extract": ["last_number"]})
    assert reward_fn(["q"], ["\\boxed{x}"], ["x"]) == {"rewards": [0.0], "extra_logs": {"math/extracted": [0.0]}}
    configure({})
    assert reward_fn(["q"], [completion], ["4"])["rewards"] == [1.0]


@pytest.mark.parametrize("options,message", [
    ({"extrct": ["boxed"], "timeout": 1}, "unknown keys ['extrct', 'timeout']"),
    ({"extract": ["boxed", "latex"]}, "unknown modes ['latex'] (allowed: ['boxed', 'answer_is', 'last_number'])"),
    ({"extract": "boxed"}, "extract='boxed': expected a non-empty list"),
    ({"extract": []}, "extract=[]: expected a non-empty list"),
    ({"timeout_s": 0}, "timeout_s=0: expected a number > 0"),
    ({"timeout_s": "5"}, "timeout_s='5': expected a number > 0"),
])
def test_configure_rejects_bad_options(options, message):
    with pytest.raises(ValueError) as e:
        configure(options)
    assert message in str(e.value)
    assert reward_fn(["q"], ["\\boxed{4}"], ["4"])["rewards"] == [1.0]  # the defaults still hold


def test_the_worker_scores_completions():
    fn = RewardFn(math_reward.__file__, timeout_s=30)
    try:
        out = fn.score([make_rollout("q", "so \\boxed{\\dfrac{1}{2}}", "0.5"),
                        make_rollout("q", "The answer is 1,000.", "1000", sample_index=1),
                        make_rollout("q", "The answer is [1,2].", "[1,2)", sample_index=2),
                        make_rollout("q", "no idea", "3", sample_index=3)])
        assert [s.value for s in out] == [1.0, 1.0, 0.0, 0.0]
        assert [s.extra for s in out] == [{"math/extracted": v} for v in (1.0, 1.0, 1.0, 0.0)]
    finally:
        fn.close()


def test_a_hanging_answer_costs_one_worker_timeout():
    # the worker's limit (3 s) comes before math-verify's (5 s by default): the call is killed
    fn = RewardFn(math_reward.__file__, timeout_s=3)
    try:
        t = time.monotonic()
        out = fn.score([make_rollout("q", "\\boxed{7}", "7"), make_rollout("q", PATHOLOGICAL, "1", sample_index=1)])
        took = time.monotonic() - t
        assert [s.value for s in out] == [None, None]
        assert all("did not return within 3s" in s.error for s in out)
        assert fn.timeouts == 1 and took < 20
        again = fn.score([make_rollout("q", "\\boxed{7}", "7")])  # a fresh worker
        assert [s.value for s in again] == [1.0] and fn.timeouts == 1
    finally:
        fn.close()


def test_a_hanging_answer_scores_zero_at_math_verifys_limit():
    # the worker's limit (30 s) is past math-verify's (5 s): the sample scores 0.0 and the batch is kept
    fn = RewardFn(math_reward.__file__, timeout_s=30)
    try:
        t = time.monotonic()
        out = fn.score([make_rollout("q", PATHOLOGICAL, "1"), make_rollout("q", "\\boxed{7}", "7", sample_index=1)])
        took = time.monotonic() - t
        assert [s.value for s in out] == [0.0, 1.0]
        assert out[0].extra == {"math/extracted": 1.0}
        assert fn.timeouts == 0 and fn.crashes == 0 and took < 25
        assert [s.value for s in fn.score([make_rollout("q", "\\boxed{8}", "8")])] == [1.0]
    finally:
        fn.close()
