"""The reward function component: a user's Python file, run in a worker process of its own.

The file defines one of

    reward_fn(prompts, completions, labels) -> list[float]                    Conveyor's
    reward_func(queries, prompts, labels, **kwargs) -> tensor | dict          OpenRLHF's (0.11)

and `reward_fn` wins when it defines both. Either gets the dataset row's other columns as keyword
arguments (`Rollout.columns`, buffer/prompts.py: one list per column, None for a row without it),
those its signature names, or all with `**kwargs`; a column named like a positional argument is left
out. A name without `/` or `.py` is a built-in (`scorer.reward_fn: math`: actors/verifiers/math.py);
`options` (scorer.reward_fn_options) go to the file's `configure(options)` when the worker starts.
OpenRLHF's `queries` are prompt + completion text
(`actors.rewards.openrlhf_texts`: decoded from the token ids with special tokens kept when the scorer
has the policy's tokenizer, `scorer.tokenizer`), and it may return `{"rewards", "scores",
"extra_logs"}`: `scores` are what dynamic sampling judges instead of the reward, `extra_logs` named
numbers the learner logs per step (`actors.rewards.read_reply`). OpenRLHF calls its function one
sample at a time; here it gets a message's samples in one call, as `reward_fn` does (the batch
arguments are lists either way). A file that mentions `openrlhf` runs with OpenRLHF's modules stood
in (actors/envs/openrlhf_agent.py `openrlhf_standin`: `from openrlhf.utils import extract_boxed_answer,
grade_answer` works without OpenRLHF), for the worker's whole life, so imports inside the function work too.

The worker is `spawn`ed (nothing of the scorer's state is forked into it); it imports the file once,
says which function it found, then answers one request per message:

    scorer  --{"prompts"|"queries", "completions"?, "labels"}-->  worker
    scorer  <--{"rewards", "scores"?, "extra_logs"?}  or  {"error": "TypeName: message"}--  worker

each a msgpack frame on a pipe (never pickle): tensors and arrays become lists of numbers in the
worker. A call that runs past `timeout_s`, or a worker that dies, fails that call's samples; the worker
is then SIGKILLed with anything it started, and a fresh one takes the next call. A reward function
that hangs costs one timeout, not the scorer.
"""

from __future__ import annotations

import atexit
import importlib.util
import inspect
import json
import multiprocessing
import multiprocessing.connection
import numbers
import os
import signal
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import msgpack

from actors.envs.openrlhf_agent import openrlhf_standin
from actors.rewards import Score, openrlhf_texts, read_reply
from actors.verifiers import resolve

if TYPE_CHECKING:
    from buffer.messages import Rollout

START_TIMEOUT_S = 300.0  # a fresh worker may take this long to start Python and import the user's file
CLOSE_WAIT_S = 5.0  # a closed worker gets this long to exit on its own before it is killed
FUNCTIONS = {"reward_fn": "conveyor", "reward_func": "openrlhf"}  # the name a file defines -> its signature


class RewardFn:
    """A reward file's function (see the module docstring), called batched in a worker process.
    `signature` is `conveyor` or `openrlhf`, read from the file; `timeouts` and `crashes` count the
    calls lost to a timeout or a dead worker; `close()` stops the worker. `tokenizer`: the policy's,
    for OpenRLHF's `queries`."""

    name = "reward_fn"

    def __init__(self, path: str, timeout_s: float = 60.0, tokenizer=None, options: dict | None = None):
        p = Path(resolve(path))
        if not p.is_file():
            raise FileNotFoundError(f"scorer.reward_fn={path!r}: no such file")
        self.path, self.timeout_s, self.tokenizer, self.options = str(p), timeout_s, tokenizer, dict(options or {})
        self.signature = ""
        self.timeouts = 0  # calls killed for running past timeout_s
        self.crashes = 0  # calls during which the worker died
        self.proc = self.conn = None
        self._start()  # a file that does not import fails the scorer now, with the import's error

    def _start(self) -> None:
        """A fresh worker, returned once it has imported the file; raises what went wrong if it could not."""
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(self.path, child, self.options), name="reward_fn")
        self.proc.start()
        child.close()  # the worker holds the only other end: its exit reads as EOF here, and ours there
        # Not a daemon (the user's code may start processes of its own), so multiprocessing joins it at
        # exit; this closes it before that (atexit runs the last registered first).
        atexit.register(self.close)
        error = self._handshake()
        if error is not None:
            self.close()
            raise error

    def _handshake(self) -> Exception | None:
        """None once the worker says it imported the file and found its function, else what went wrong."""
        where = f"scorer.reward_fn={self.path!r}"
        try:
            if not self.conn.poll(START_TIMEOUT_S):
                return TimeoutError(f"{where} did not import within {START_TIMEOUT_S:g}s")
            ready = msgpack.unpackb(self.conn.recv_bytes())
        except (EOFError, OSError):
            return RuntimeError(f"{where}: the worker died importing it ({_exit_reason(self._kill())})")
        if "error" in ready:
            return ImportError(f"{where} failed to import: {ready['error']}")
        if not ready["ready"]:
            return AttributeError(f"{where} defines no callable `reward_fn` (prompts, completions, labels: "
                                  f"Conveyor's) or `reward_func` (queries, prompts, labels: OpenRLHF's)")
        self.signature = ready["ready"]
        return None

    def _kill(self) -> int | None:
        """SIGKILL the worker and whatever it started (it leads a process group); its exit code.

        The group is killed before the worker is reaped: until then its pid, the group's id, cannot be
        reused by another process."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # not a group leader yet
            self.proc.kill()
        self.proc.join()
        self.conn.close()
        code, self.proc, self.conn = self.proc.exitcode, None, None
        atexit.unregister(self.close)
        return code

    def close(self) -> None:
        """Stop the worker: it exits when its pipe closes; killed if it has not after CLOSE_WAIT_S."""
        if self.proc is not None:
            self.conn.close()
            multiprocessing.connection.wait([self.proc.sentinel], CLOSE_WAIT_S)  # exited, not reaped
            self._kill()  # also takes down any process the user's code left behind

    def _request(self, rollouts: Sequence[Rollout]) -> bytes:
        labels = [r.label for r in rollouts]
        columns = [r.columns for r in rollouts]  # (JSON objects, read in the worker)
        if self.signature == "openrlhf":
            queries, prompts = openrlhf_texts(rollouts, self.tokenizer)
            return msgpack.packb({"queries": queries, "prompts": prompts, "labels": labels, "columns": columns})
        return msgpack.packb({"prompts": [r.prompt for r in rollouts],
                              "completions": [r.completion for r in rollouts], "labels": labels, "columns": columns})

    def _call(self, rollouts: Sequence[Rollout]) -> list[Score]:
        n = len(rollouts)
        if self.proc is None:  # the last call killed it
            try:
                self._start()
            except Exception as e:
                return [Score(None, f"reward_fn worker could not restart: {e}")] * n
        request = self._request(rollouts)
        try:
            self.conn.send_bytes(request)
            if not self.conn.poll(self.timeout_s):
                self._kill()
                self.timeouts += 1
                return [Score(None, f"reward_fn did not return within {self.timeout_s:g}s (worker killed)")] * n
            reply = msgpack.unpackb(self.conn.recv_bytes())
        except (EOFError, OSError):  # the worker is gone: a closed pipe, or a reset one
            self.crashes += 1
            return [Score(None, f"reward_fn worker died ({_exit_reason(self._kill())})")] * n
        if "error" in reply:
            return [Score(None, f"reward_fn raised {reply['error']}")] * n
        return read_reply(reply["answer"], n, self.name)

    def score(self, rollouts: Sequence[Rollout]) -> list[Score]:
        out = self._call(rollouts)
        if len(rollouts) > 1 and all(s.error.startswith("reward_fn raised") for s in out):
            # One bad sample should not fail the whole message: find which ones raise. A timeout ends
            # the search (each would cost another timeout_s) and fails the samples not yet tried.
            out = []
            for r in rollouts:
                timeouts = self.timeouts
                out.append(self._call([r])[0])
                if self.timeouts > timeouts:
                    out += [out[-1]] * (len(rollouts) - len(out))
                    break
        return out


def _worker(path: str, conn, options: dict | None = None) -> None:
    """The worker process: import `path` once (and `configure(options)` it), then answer requests
    until the scorer closes the pipe."""
    # A group of its own: a Ctrl-C to the scorer's terminal does not reach it (the scorer decides when
    # it stops), and the scorer's SIGKILL to the group reaches anything the user's code started.
    os.setpgrp()
    p = Path(path)
    with openrlhf_standin() if "openrlhf" in p.read_text(errors="replace") else nullcontext():
        try:
            spec = importlib.util.spec_from_file_location(f"conveyor_reward_{p.stem}", p)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # (dataclasses and pickling look their module up by name)
            spec.loader.exec_module(module)
            found = [(getattr(module, name), kind) for name, kind in FUNCTIONS.items()
                     if callable(getattr(module, name, None))]
            configure = getattr(module, "configure", None)
            if callable(configure):
                configure(dict(options or {}))
            elif options:
                raise TypeError(f"scorer.reward_fn_options {sorted(options)} given, but the file defines no "
                                f"configure(options) to take them")
        except Exception as e:
            conn.send_bytes(msgpack.packb({"error": f"{type(e).__name__}: {e}"}))
            return
        conn.send_bytes(msgpack.packb({"ready": found[0][1] if found else ""}))
        if found:
            _serve(conn, *found[0])


def _serve(conn, fn, signature: str) -> None:
    positional = ("queries", "prompts", "labels") if signature == "openrlhf" else ("prompts", "completions", "labels")
    accepts = _keywords(fn, positional)
    while True:
        try:
            request = msgpack.unpackb(conn.recv_bytes())
        except EOFError:  # the scorer closed the pipe (or exited)
            return
        try:
            kwargs = column_kwargs(request.get("columns") or [], accepts, positional)
            raw = fn(*(request[k] for k in positional), **kwargs)
            # tensors, arrays and their scalars as plain numbers; read_reply (in the scorer) judges them
            reply = msgpack.packb({"answer": _plain(raw)}, default=_unsendable)
        except Exception as e:  # user code: anything may come out of it
            reply = msgpack.packb({"error": f"{type(e).__name__}: {e}"})
        conn.send_bytes(reply)


def _keywords(fn, positional: Sequence[str]):
    """The keyword names `fn` takes besides its positional ones: a set, or None for all (**kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - set(positional)


def column_kwargs(columns: Sequence[str], accepts, positional: Sequence[str]) -> dict[str, list]:
    """One list per column (None where a row lacks it) from the samples' JSON objects, the columns
    `accepts` names (None: all) but those named like a positional argument."""
    rows = [json.loads(c) if c else {} for c in columns]
    names = sorted({k for r in rows for k in r} - set(positional))
    if accepts is not None:
        names = [k for k in names if k in accepts]
    return {k: [r.get(k) for r in rows] for k in names}


def _plain(x):
    """A returned value as msgpack can send it: tensors and arrays (torch's on any device) as lists or
    numbers, dicts and lists walked; other values as they are (msgpack refuses what it cannot send)."""
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu()
    if hasattr(x, "tolist") and not isinstance(x, (list, tuple, dict, str, bytes)):
        return x.tolist()
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, numbers.Real) and not isinstance(x, (int, float)):  # e.g. fractions, decimals
        return float(x)
    return x


def _unsendable(x):
    raise TypeError(f"returned a {type(x).__name__}, which cannot be sent to the scorer")


def _exit_reason(code: int | None) -> str:
    return f"killed by signal {-code} ({signal.strsignal(-code)})" if code and code < 0 else f"exit code {code}"
