"""The `code` reward: finding the program, reading the tests, and scoring programs that pass, answer
wrongly, crash, hang, exit early or reach for the network, in both test styles and both modes; the
bound on sandboxed runs at once; and the file run by the real reward-function worker."""

from __future__ import annotations

import json
import socket
import time

import pytest

import actors.verifiers.code as verifier
from actors.reward_files import RewardFn
from tests.helpers.scoring import make_rollout

ADDS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
SUMS = {"inputs": ["1 2\n", "3 4\n", "10 -10\n"], "outputs": ["3\n", "7\n", "0\n"]}


@pytest.fixture(autouse=True)
def default_options():
    verifier.configure({})
    yield
    verifier.configure({})


def fenced(program: str, tag: str = "python") -> str:
    return f"Here is my solution.\n```{tag}\n{program}```\nIt adds the numbers."


def score(completions: list[str], labels=None, tests=None) -> dict:
    labels = labels if labels is not None else [None] * len(completions)
    return verifier.reward_fn(["prompt"] * len(completions), completions, labels, tests=tests)


# ---------------------------------------------------------------- finding the program, reading the tests


def test_extract_code_takes_the_last_python_block():
    two = "First try:\n```python\nx = 1\n```\nBetter:\n```\nx = 2\n```\n"
    assert verifier.extract_code(two) == "x = 2\n"
    # a block in another language (the expected output, say) is passed over; py and python3 count
    assert verifier.extract_code("```py\nx = 3\n```\nOutput:\n```text\n3\n```") == "x = 3\n"
    assert verifier.extract_code("```Python3\nx = 4\n```") == "x = 4\n"
    # an indented block (inside a list item) is dedented
    assert verifier.extract_code("1. Code:\n   ```python\n   def f():\n       return 5\n   ```\n") == \
        "def f():\n    return 5\n"
    for none in ("x = 1", "```python\nx = 1\n", "```python\n\n```", "```bash\nls\n```", "inline ```x = 1``` only"):
        assert verifier.extract_code(none) is None, none


def test_parse_tests_reads_both_styles_and_refuses_malformed_ones():
    asserts = [verifier.Case(assertion=t) for t in ADDS]
    stdio = [verifier.Case(stdin=i, expected=o) for i, o in zip(SUMS["inputs"], SUMS["outputs"])]
    assert verifier.parse_tests(ADDS) == verifier.parse_tests(json.dumps(ADDS)) == asserts
    assert verifier.parse_tests(SUMS) == verifier.parse_tests(json.dumps(SUMS)) == stdio
    assert verifier.parse_tests(None) == verifier.parse_tests([]) == []
    for bad, why in [("assert f()", "not JSON"), ([1, 2], "strings"), ({"inputs": ["1"]}, "exactly the keys"),
                     ({"inputs": ["1"], "outputs": []}, "same length"), ({"inputs": [1], "outputs": [1]}, "strings"),
                     ({"inputs": [], "outputs": [], "fn_name": "f"}, "fn_name"), (42, "got int")]:
        with pytest.raises(ValueError, match=why):
            verifier.parse_tests(bad)
    # the `tests` column must parse; a label that is not tests (a plain answer) means no tests
    assert verifier.tests_of(None, json.dumps(ADDS)) == asserts
    assert verifier.tests_of(ADDS, "42") == asserts
    assert verifier.tests_of(None, "42") == verifier.tests_of(None, "the answer") == verifier.tests_of(None, None) == []
    with pytest.raises(ValueError, match="not JSON"):
        verifier.tests_of("assert f()", None)


def test_configure_refuses_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match=r"unknown keys \['mdoe', 'timeout'\]"):
        verifier.configure({"mdoe": "all", "timeout": 3})
    for options, why in [({"mode": "any"}, "mode='any'"), ({"language": "cpp"}, "language='cpp'"),
                         ({"concurrency": 0}, "concurrency=0"), ({"concurrency": 1.5}, "concurrency=1.5"),
                         ({"timeout_s": 0}, "timeout_s=0"), ({"memory_mb": 32}, "memory_mb=32"),
                         ({"timeout_s": "soon"}, "timeout_s='soon'")]:
        with pytest.raises(ValueError, match=why):
            verifier.configure(options)
    assert verifier.OPTIONS == verifier.Options()  # a refused configure changes nothing
    verifier.configure({"mode": "all", "timeout_s": 3, "concurrency": 2})
    assert verifier.OPTIONS == verifier.Options(mode="all", timeout_s=3.0, concurrency=2)
    verifier.configure({})
    assert verifier.OPTIONS == verifier.Options(mode="fraction", timeout_s=10.0, memory_mb=512, concurrency=4)


def test_rows_without_tests_score_zero_and_are_counted():
    program = fenced("def add(a, b):\n    return a + b\n")
    out = score([program, program, "no code here"], labels=[None, "3", json.dumps(ADDS)])
    assert out["rewards"] == [0.0, 0.0, 0.0]
    assert out["extra_logs"]["code/no_tests"] == [1, 1, 0]
    assert out["extra_logs"]["code/no_code"] == [0, 0, 1]
    with pytest.raises(ValueError, match=r"sample 1: bad tests: .*same length"):
        score([program, program], tests=[ADDS, {"inputs": ["1"], "outputs": []}])


# ---------------------------------------------------------------- programs in the sandbox

ASSERT_PROGRAMS = [
    "def add(a, b):\n    return a + b\n",  # right: 3/3
    "def add(a, b):\n    return a * b\n",  # wrong answers: only 2 * 2 == 2 + 2, 1/3
    "def add(a, b):\n    return a + b\nraise RuntimeError('crash on import')\n",  # raises: 0/3
    "import sys\ndef add(a, b):\n    return a + b\nsys.exit(0)\n",  # exits before the asserts run: 0/3
    # a __main__ block that reads stdin is left out when the asserts import the program: 3/3
    "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))\n",
]


@pytest.mark.parametrize("mode", ["fraction", "all"])
def test_assert_tests_in_both_modes(mode):
    verifier.configure({"mode": mode})
    completions = [fenced(p) for p in ASSERT_PROGRAMS] + ["I would add them."]
    out = score(completions, tests=[ADDS] * len(completions))
    fractions = [1.0, 1 / 3, 0.0, 0.0, 1.0, 0.0]
    assert out["extra_logs"]["code/pass_frac"] == pytest.approx(fractions)
    assert out["rewards"] == pytest.approx(fractions if mode == "fraction" else [1.0, 0, 0, 0, 1.0, 0])
    assert out["extra_logs"]["code/no_code"] == [0, 0, 0, 0, 0, 1]
    assert out["extra_logs"]["code/timeouts"] == [0] * 6


STDIO_PROGRAMS = [
    "a, b = map(int, input().split())\nprint(a + b)\n",  # right
    "import sys\na, b = map(int, sys.stdin.buffer.read().split())\nprint(a + b, '  ')\nprint()\n",  # right, spaces
    "a, b = map(int, open(0).read().split())\nprint(a + b)\n",  # right, reading fd 0
    "a, b = map(int, input().split())\nprint(a - b)\n",  # wrong unless b == 0: none of the three
    "a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1)\n",  # right output, exit status 1
    "a, b = map(int, input().split())\nprint(a + b if a < 10 else 'ten')\n",  # wrong on the last: 2/3
]


def test_stdin_stdout_tests_from_the_column_or_the_label():
    completions = [fenced(p) for p in STDIO_PROGRAMS]
    n = len(completions)
    # the tests as a dict in the `tests` column, and as JSON in the label with the column left out
    for out in (score(completions, tests=[SUMS] * n), score(completions, labels=[json.dumps(SUMS)] * n)):
        assert out["rewards"] == pytest.approx([1.0, 1.0, 1.0, 0.0, 0.0, 2 / 3])
        assert out["extra_logs"]["code/no_tests"] == [0] * n
    verifier.configure({"mode": "all"})
    assert score(completions, tests=[json.dumps(SUMS)] * n)["rewards"] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_a_hanging_test_is_killed_at_its_timeout_and_counted():
    verifier.configure({"timeout_s": 1.0})
    program = fenced("def f(x):\n    while x == 0:\n        pass\n    return x\n")
    stdin_hang = fenced("x = int(input())\nwhile x == 0:\n    pass\nprint(x)\n")
    start = time.monotonic()
    out = score([program, stdin_hang], tests=[["assert f(1) == 1", "assert f(0) == 0", "assert f(2) == 2"],
                                              {"inputs": ["0\n", "5\n"], "outputs": ["0\n", "5\n"]}])
    took = time.monotonic() - start
    assert out["rewards"] == pytest.approx([2 / 3, 0.5])
    assert out["extra_logs"]["code/timeouts"] == [1, 1]
    assert took < 1.0 + 4.0, f"two 1 s timeouts, run at once, took {took:.1f}s"


def test_a_program_that_needs_the_network_fails_without_hanging():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    program = fenced("import socket\n"
                     "def reach(host, port):\n"
                     "    socket.create_connection((host, port), timeout=5).close()\n"
                     "    return True\n"
                     "def unreachable():\n"
                     "    try:\n"
                     "        reach('1.1.1.1', 53)\n"
                     "    except OSError as e:\n"
                     "        return 'unreachable' in str(e)\n")
    tests = ["assert reach('1.1.1.1', 53)", f"assert reach('127.0.0.1', {port})", "assert unreachable()"]
    try:
        start = time.monotonic()
        out = score([program], tests=[tests])
        took = time.monotonic() - start
        with pytest.raises(BlockingIOError):  # nothing reached our loopback
            listener.accept()
    finally:
        listener.close()
    # both connections fail at once (no route: no 5 s connect timeout), and the program did run
    assert out["rewards"] == pytest.approx([1 / 3]) and out["extra_logs"]["code/timeouts"] == [0]
    assert took < 5.0, f"failing to connect took {took:.1f}s"


# Each test logs "start PID" and "end PID" to a shared file and holds until the log has shown `bound`
# runs at once since its start, and then 0.5 s more (time for any run past the bound to start), or
# until all `total` have started (so the last ones never wait for company).
HOLD = """import os, time
LOG = {log!r}
def hold(total, bound):
    me = f"start {{os.getpid()}}"
    with open(LOG, "a") as f:
        f.write(me + "\\n")
    deadline, full_since = time.monotonic() + 20, None
    while time.monotonic() < deadline:
        lines = open(LOG).read().splitlines()
        running = [0]
        for line in lines:
            running.append(running[-1] + (1 if line.startswith("start") else -1))
        if full_since is None and max(running[lines.index(me) + 1:]) >= bound:
            full_since = time.monotonic()
        if sum(l.startswith("start") for l in lines) == total or (full_since and time.monotonic() > full_since + 0.5):
            break
        time.sleep(0.01)
    with open(LOG, "a") as f:
        f.write(f"end {{os.getpid()}}\\n")
    return time.monotonic() < deadline
"""


def test_runs_at_once_never_exceed_concurrency(tmp_path):
    # 2 samples x 4 tests share one bound of 3: the first three hold until all three are running, so
    # the log shows exactly 3 at once; never 4 (without the bound all 8 would start while they hold).
    log = tmp_path / "runs.log"
    log.touch()
    verifier.configure({"concurrency": 3, "timeout_s": 30})
    program = fenced(HOLD.format(log=str(log)))
    out = score([program, program], tests=[["assert hold(8, 3)"] * 4] * 2)
    assert out["rewards"] == [1.0, 1.0], out
    running, most = 0, 0
    for line in log.read_text().splitlines():
        running += 1 if line.startswith("start") else -1
        most = max(most, running)
    assert most == 3 and running == 0 and len(log.read_text().splitlines()) == 16


# ---------------------------------------------------------------- through the reward-function worker


def test_the_reward_function_worker_runs_the_file():
    scorer = RewardFn(verifier.__file__, timeout_s=60)
    try:
        assert scorer.signature == "conveyor"
        out = scorer.score([
            make_rollout("add", fenced(ASSERT_PROGRAMS[0]), json.dumps(ADDS)),
            make_rollout("add", fenced(ASSERT_PROGRAMS[1]), json.dumps(ADDS), sample_index=1),
            make_rollout("sum", fenced(STDIO_PROGRAMS[0]), json.dumps(SUMS), sample_index=2),
            make_rollout("sum", "no code", json.dumps(SUMS), sample_index=3),
            make_rollout("add", fenced(ASSERT_PROGRAMS[0]), "3", sample_index=4),  # a label that is no tests
        ])
    finally:
        scorer.close()
    assert [s.error for s in out] == [""] * 5
    assert [s.value for s in out] == pytest.approx([1.0, 1 / 3, 1.0, 0.0, 0.0])
    assert [s.extra["code/no_code"] for s in out] == [0, 0, 0, 1, 0]
    assert [s.extra["code/no_tests"] for s in out] == [0, 0, 0, 0, 1]
    assert [s.extra["code/timeouts"] for s in out] == [0] * 5
