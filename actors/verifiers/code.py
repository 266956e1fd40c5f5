"""The `code` reward: run the completion's program against the row's tests, each test in the sandbox.

The program is the completion's last fenced code block (```python or a bare ```; see `extract_code`);
a completion without one scores 0. The tests come from the row's `tests` column, else from its label
read as JSON, in either of two styles:

    ["assert add(1, 2) == 3", ...]                         asserts: the program, then one assert line
    {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}     stdin/stdout: the program fed one input

(or a JSON string of either). Each test is one run of `actors.tools.sandbox.run_python`: a fresh
Python process with no network, its own time limit (`timeout_s`), address-space limit (`memory_mb`),
capped output and file sizes, and its process group killed at the end. An assert test passes when
the program (run as a module: its `__main__` block left out) and the assert both run to the end (a
program that exits early fails it); a stdin/stdout test passes when the program exits with status 0
and its stdout matches the expected output, trailing whitespace of each line and trailing blank lines
aside. The reward is the share of tests passed (`mode: fraction`) or 1.0 only when all pass
(`mode: all`); a row with no tests scores 0 and is counted in `code/no_tests`.

What the sandbox does NOT protect against (it is for a policy's mistakes, not a jail for hostile code):
the program reads and writes the filesystem as usual (the script that runs it included, so a program
that goes looking can fake a pass), and a process it starts that leaves the group (`setsid`) outlives
the run until its CPU limit ends it. Where the kernel refuses network namespaces the program runs
with the network (`SandboxResult.network` says what it got).

All tests of all samples of one call run concurrently, `concurrency` at a time, so one call takes up
to about samples x tests x timeout_s / concurrency: `scorer.reward_fn_timeout_s` must exceed that.
Else the call fails, and the runs in flight when the worker is killed outlive it (each is a session
of its own): a busy one until its CPU limit, a sleeping one until it wakes.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import signal
import textwrap
from dataclasses import dataclass, fields, replace

from actors.tools.sandbox import SandboxLimits, SandboxResult, run_python


@dataclass(frozen=True)
class Options:
    """`scorer.reward_fn_options` for `reward_fn: code`."""

    mode: str = "fraction"
    """"fraction": the share of tests passed; "all": 1.0 only when every test passes, else 0.0."""
    timeout_s: float = 10.0
    """Wall-clock seconds for one test's run (the CPU limit is the same, rounded up)."""
    memory_mb: int = 512
    """Address space of one test's run."""
    concurrency: int = 4
    """Sandboxed runs at once, over all the tests of all the samples of a call."""
    language: str = "python"
    """The programs' language; only Python runs."""


MODES = ("fraction", "all")
OPTIONS = Options()


def configure(options: dict) -> None:
    """Set the options (see `Options`): the defaults, updated with `options`. Raises ValueError naming
    an unknown key or a bad value."""
    global OPTIONS
    options = dict(options or {})
    unknown = sorted(set(options) - {f.name for f in fields(Options)})
    if unknown:
        raise ValueError(f"reward_fn_options for code: unknown keys {unknown}; "
                         f"known: {[f.name for f in fields(Options)]}")
    new = replace(Options(), **options)
    if new.mode not in MODES:
        raise ValueError(f"reward_fn_options.mode={new.mode!r}: expected one of {list(MODES)}")
    if new.language != "python":
        raise ValueError(f"reward_fn_options.language={new.language!r}: only 'python' is supported")
    if isinstance(new.concurrency, bool) or not isinstance(new.concurrency, int) or new.concurrency < 1:
        raise ValueError(f"reward_fn_options.concurrency={new.concurrency!r}: expected an integer >= 1")
    try:
        checked = limits(new)
    except (TypeError, ValueError) as e:
        raise ValueError(f"reward_fn_options timeout_s={new.timeout_s!r}, memory_mb={new.memory_mb!r}: "
                         f"expected timeout_s > 0 and memory_mb >= 64 ({e})") from None
    OPTIONS = replace(new, timeout_s=checked.timeout_s, memory_mb=checked.memory_mb)


def limits(options: Options) -> SandboxLimits:
    return SandboxLimits(timeout_s=float(options.timeout_s), memory_mb=int(options.memory_mb))


# A fence opening a line (indented, say in a list item), its tag, the body, a closing fence on a line of its own.
FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.MULTILINE | re.DOTALL)
PYTHON_TAGS = ("", "python", "python3", "py")


def extract_code(completion: str) -> str | None:
    """The body of the last closed fenced code block tagged python (or untagged), dedented; None if none.

    Blocks tagged another language (a ```text block showing the output, say) are passed over."""
    blocks = [body for tag, body in FENCE.findall(completion) if tag.lower() in PYTHON_TAGS and body.strip()]
    return textwrap.dedent(blocks[-1]) if blocks else None


@dataclass(frozen=True)
class Case:
    """One test: an assert line run after the program, or an input for stdin and the stdout expected."""

    assertion: str | None = None
    stdin: str = ""
    expected: str | None = None


def parse_tests(raw) -> list[Case]:
    """The tests in `raw`: a list of assert strings, {"inputs": [...], "outputs": [...]} (strings, as
    many of each), a JSON string of either, or None (no tests). Raises ValueError for anything else."""
    if raw is None:
        return []
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON ({e})") from None
    if isinstance(raw, list):
        if not all(isinstance(t, str) for t in raw):
            raise ValueError("a list of tests must hold assert statements as strings")
        return [Case(assertion=t) for t in raw]
    if isinstance(raw, dict):
        if set(raw) != {"inputs", "outputs"}:
            raise ValueError(f"stdin/stdout tests have exactly the keys inputs and outputs, got {sorted(raw)}")
        inputs, outputs = raw["inputs"], raw["outputs"]
        if not (isinstance(inputs, list) and isinstance(outputs, list) and len(inputs) == len(outputs)
                and all(isinstance(x, str) for x in inputs + outputs)):
            raise ValueError("inputs and outputs must be lists of strings of the same length")
        return [Case(stdin=i, expected=o) for i, o in zip(inputs, outputs)]
    raise ValueError(f"expected a list of asserts or an inputs/outputs dict, got {type(raw).__name__}")


def tests_of(tests, label) -> list[Case]:
    """A sample's tests: its `tests` value (which must parse), else its label if that holds tests
    (a label that is not tests JSON, such as a plain answer, means no tests)."""
    if tests is not None:
        return parse_tests(tests)
    try:
        return parse_tests(label)
    except ValueError:
        return []


def case_script(program: str, case: Case, token: str) -> str:
    """The file the sandbox runs for one test: stdin made from the case's input (a file on fd 0, so
    `input()`, `sys.stdin.buffer` and `open(0)` all read it), then the program. For an assert test the
    program runs as a module a test imports (`__name__` is "solution": a `__main__` block that would
    read stdin stays out), then the assert, then `token` on stderr: the proof that the assert ran (an
    early `exit(0)` does not print it)."""
    name = "__main__" if case.assertion is None else "solution"
    return (f"import os, sys\n"
            f"with open('stdin.txt', 'w', encoding='utf-8') as f:\n"
            f"    f.write({case.stdin!r})\n"
            f"fd = os.open('stdin.txt', os.O_RDONLY)\n"
            f"os.dup2(fd, 0)\n"
            f"os.close(fd)\n"
            f"namespace = {{'__name__': {name!r}, '__file__': 'solution.py'}}\n"
            f"exec(compile({program!r}, 'solution.py', 'exec'), namespace)\n"
            + ("" if case.assertion is None else
               f"exec(compile({case.assertion!r}, 'test.py', 'exec'), namespace)\n"
               f"sys.stderr.write({token!r})\n"))


def same_output(got: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines."""
    def norm(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]
    return norm(got) == norm(expected)


@dataclass(frozen=True)
class Outcome:
    passed: bool
    timed_out: bool


def judge(case: Case, result: SandboxResult, token: str) -> Outcome:
    # The CPU limit (SIGXCPU) is the same time limit, met first by a program that never sleeps.
    timed_out = result.timed_out or result.returncode == -signal.SIGXCPU
    if case.assertion is not None:
        passed = result.returncode == 0 and token in result.stderr
    else:
        passed = result.returncode == 0 and not result.stdout_dropped and same_output(result.stdout, case.expected)
    return Outcome(passed and not timed_out, timed_out)


async def run_case(program: str, case: Case, options: Options, gate: asyncio.Semaphore) -> Outcome:
    token = secrets.token_hex(16)
    async with gate:
        result = await run_python(case_script(program, case, token), limits(options))
    return judge(case, result, token)


async def run_all(programs: list[str | None], cases: list[list[Case]], options: Options) -> list[list[Outcome]]:
    """Every test of every sample with a program, `options.concurrency` at a time; outcomes per sample."""
    gate = asyncio.Semaphore(options.concurrency)
    jobs = [(i, run_case(program, case, options, gate))
            for i, (program, sample_cases) in enumerate(zip(programs, cases)) if program is not None
            for case in sample_cases]
    done = await asyncio.gather(*(job for _, job in jobs))
    out: list[list[Outcome]] = [[] for _ in programs]
    for (i, _), outcome in zip(jobs, done):
        out[i].append(outcome)
    return out


def reward_fn(prompts, completions, labels, tests=None, **columns) -> dict:
    """Rewards for a batch (see the module docstring), with per-sample logs: `code/pass_frac`,
    `code/timeouts` (tests killed at the time limit), `code/no_code` and `code/no_tests` (0 or 1).

    Raises ValueError, before running anything, when a sample's `tests` value is malformed."""
    n = len(completions)
    labels = labels if labels is not None else [None] * n
    tests = tests if tests is not None else [None] * n
    cases = []
    for i in range(n):
        try:
            cases.append(tests_of(tests[i], labels[i]))
        except ValueError as e:
            raise ValueError(f"sample {i}: bad tests: {e}") from None
    programs = [extract_code(c) for c in completions]
    options = OPTIONS
    outcomes = asyncio.run(run_all(programs, cases, options))
    rewards, pass_frac, timeouts = [], [], []
    for sample_cases, sample in zip(cases, outcomes):
        passed = sum(o.passed for o in sample)
        frac = passed / len(sample_cases) if sample_cases and sample else 0.0
        pass_frac.append(frac)
        timeouts.append(sum(o.timed_out for o in sample))
        rewards.append(frac if options.mode == "fraction" else float(bool(sample) and passed == len(sample)))
    return {"rewards": rewards,
            "extra_logs": {"code/pass_frac": pass_frac, "code/timeouts": timeouts,
                           "code/no_code": [int(p is None) for p in programs],
                           "code/no_tests": [int(not c) for c in cases]}}
