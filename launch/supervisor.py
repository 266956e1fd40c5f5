"""`launch.local`'s supervision: start each role of the plan (launch/roles.py), heal the ones that
may die, stop them all.

Every role runs in its own session (launch/process.py), so stopping a role also stops what it
spawned (vLLM's engine core, DeepSpeed's ranks) and nothing is orphaned. A role whose spec waits for
readiness must write its ready file before the next one starts. A generator or scorer that exits
with an error is started again after its restart delay, while it has restarts left; the first
required role to fail, or every generator (every scorer) gone for good, stops the run with a
`RoleFailed` that names the role and its exit code.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from launch.process import Process
from launch.recovery import EXIT_CODES
from launch.roles import RoleSpec, State, after_exit, gone_for_good


@dataclass
class Role:
    """One supervised process of the run: its spec, its process, where it stands."""

    spec: RoleSpec
    proc: Process
    config: str  # the resolved config it reads
    state: State = State.NEW
    code: int | None = None
    restart_at: float = 0.0
    starts: int = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def log_path(self) -> Path:
        return self.proc.log_path

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()


class RoleFailed(RuntimeError):
    def __init__(self, role: str, code: int | None, log_path: Path | None, detail: str = ""):
        self.role, self.code, self.log_path = role, code, log_path
        where = f" (log: {log_path})" if log_path else ""
        super().__init__(f"role {role!r} exited with code {code}{where}{': ' + detail if detail else ''}")


class Supervisor:
    """Starts roles, heals them, stops them; use as a context manager so every exit path cleans up.
    `restarts` counts each role's restarts and may be shared by several supervisors (the attempts
    of one run under `run.auto_resume`): the budget is per run."""

    def __init__(self, log_dir: str | Path, ready_dir: str | Path, grace_s: float = 10.0,
                 restarts: Counter | None = None, say: Callable[[str], None] = print):
        self.log_dir, self.ready_dir = Path(log_dir), Path(ready_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.grace_s = grace_s
        self.restarts: Counter[str] = Counter() if restarts is None else restarts
        self.say = say
        self.roles: list[Role] = []

    def start(self, spec: RoleSpec, config: str | Path) -> Role:
        """Start the role; with `spec.ready.wait`, return once it is ready (RoleFailed if it is not)."""
        proc = Process(spec.name, self.log_dir / spec.log_name, self.ready_dir / f"{spec.name}.json")
        role = Role(spec, proc, str(config))
        self.roles.append(role)
        self._launch(role)
        return role

    def _launch(self, role: Role, banner: str | None = None) -> None:
        role.proc.start(role.spec.command(role.config), role.spec.env, banner=banner)
        role.state, role.code = State.RUNNING, None
        role.starts += 1
        ready = role.spec.ready
        if ready.wait and ready.probe != "none":
            why = role.proc.wait_ready(ready.timeout_s, ready.probe, port=ready.port)
            if why:
                role.state, role.code = State.FAILED, role.returncode
                raise RoleFailed(role.name, role.code, role.log_path, why)

    def restart(self, role: Role) -> None:
        """Start `role` again on the same log, after a `=== launch.local: restart` line; leftovers of
        its last run (a vLLM engine core outliving its parent) are killed first."""
        role.proc.kill()
        n = self.restarts[role.name] = self.restarts[role.name] + 1
        self._launch(role, f"launch.local: restart {n} of {role.spec.restart.max_restarts} after exit code "
                           f"{role.code} ===")

    def supervise(self) -> None:
        """One look at every role: note exits, restart what is due; raise `RoleFailed` for a required
        role that failed, or once every generator (every scorer) is gone for good."""
        now = time.monotonic()
        for role in self.roles:
            if role.state == State.RUNNING and role.returncode is not None:
                role.code = role.returncode
                role.state = after_exit(role.spec, self.restarts[role.name], role.code)
                if role.state == State.FAILED and role.spec.required:
                    raise RoleFailed(role.name, role.code, role.log_path,
                                     "\n" + role.proc.tail(disk_full=role.code == EXIT_CODES["disk"]))
                if role.state == State.RESTARTING:
                    role.restart_at = now + role.spec.restart.delay_s
                    self.say(f"{role.name} exited with code {role.code}; restart "
                             f"{self.restarts[role.name] + 1}/{role.spec.restart.max_restarts}")
            if role.state == State.RESTARTING and now >= role.restart_at:
                self.restart(role)
        for kind in ("generator", "scorer"):
            mine = [r for r in self.roles if r.spec.kind == kind]
            if gone_for_good([r.state for r in mine]):
                raise RoleFailed(kind, mine[0].code, mine[0].log_path,
                                 f"every {kind} has exited (restarts used: "
                                 f"{', '.join(f'{r.name} {self.restarts[r.name]}' for r in mine)})")

    def wait(self, role: Role, timeout_s: float | None = None, on_tick: Callable[[], None] | None = None,
             tick_s: float = 1.0) -> int:
        """Supervise until `role` is done (0); RoleFailed when it or another required role fails."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        next_tick = 0.0
        while True:
            self.supervise()
            if role.state == State.DONE:
                return 0
            if deadline is not None and time.monotonic() > deadline:
                raise RoleFailed(role.name, None, role.log_path, f"did not finish within {timeout_s:.0f}s")
            if on_tick and time.monotonic() >= next_tick:
                on_tick()
                next_tick = time.monotonic() + tick_s
            time.sleep(0.2)

    def status(self) -> list[dict]:
        """Each role as `<run_dir>/status.json` lists it."""
        return [{"name": r.name, "kind": r.spec.kind, "state": r.state.value, "pid": r.proc.pid,
                 "restarts": self.restarts[r.name], "starts": r.starts, "code": r.code, "ready": r.proc.ready()}
                for r in self.roles]

    def stop(self, roles: Sequence[Role] | None = None) -> None:
        """SIGTERM each role's process group, then SIGKILL what is left after the grace period."""
        roles = list(self.roles if roles is None else roles)
        for r in roles:
            r.proc.terminate(group=True)
        deadline = time.monotonic() + self.grace_s
        for r in roles:
            r.proc.wait(deadline - time.monotonic())
            r.proc.kill()
            if r.state in (State.RUNNING, State.RESTARTING):
                r.state, r.code = State.STOPPED, r.returncode

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
