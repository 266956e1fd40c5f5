"""The run's ledger: which prompt groups each learner step trained, `<run_dir>/ledger.jsonl`.

One JSON line per trained step, `{"step": s, "groups": [...], "wall": t}`, appended by rank 0 right
after the step's update. A checkpoint at step N needs the lines of steps 0..N-1: they are fsynced
before the checkpoint is marked complete. A learner resuming at step N keeps exactly those lines
(a crashed lineage's later steps are cut off) and tells the buffer the groups they hold, so the
buffer can issue again everything else it had served. What remains after a run is the final
lineage: `python -m launch.ledger RUN_DIR` audits it (no group trained twice, none lost).

A full disk raises `common.disk.OutOfDisk` naming the ledger: a line that cannot be written whole
is cut off again (the file ends with the last whole line), and a rewrite at `start` that cannot be
written leaves the old ledger as it was.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from common.disk import append_whole, writing

LEDGER_NAME = "ledger.jsonl"


class LedgerError(RuntimeError):
    """The ledger cannot back the checkpoint being resumed (a step is missing)."""


def read_ledger(path: str | Path) -> dict[int, list[int]]:
    """step -> group ids, the last line of each step winning; a torn last line is ignored."""
    steps: dict[int, list[int]] = {}
    p = Path(path)
    if not p.is_file():
        return steps
    for line in p.read_text().splitlines():
        try:
            row = json.loads(line)
            steps[int(row["step"])] = [int(g) for g in row["groups"]]
        except (ValueError, KeyError, TypeError):
            continue
    return steps


class Ledger:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LEDGER_NAME
        self.steps: dict[int, list[int]] = {}
        self._fd: int | None = None  # appended to unbuffered: a failed line is cut off, never left to a flush

    def start(self, step: int) -> None:
        """Keep the lines of steps < `step` (the checkpoint being resumed), drop the rest, open for appending."""
        found = read_ledger(self.path)
        missing = [s for s in range(step) if s not in found]
        if missing:
            raise LedgerError(f"{self.path} lacks steps {missing[:5]}{'...' if len(missing) > 5 else ''} of the "
                              f"checkpoint at step {step}: the groups they trained are unknown, so the buffer "
                              f"could serve them again")
        self.steps = {s: found[s] for s in range(step)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with writing(tmp), open(tmp, "w") as f:
                for s in range(step):
                    f.write(json.dumps({"step": s, "groups": self.steps[s]}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)  # the old ledger stays whole
            raise
        os.replace(tmp, self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def trained(self) -> list[int]:
        return [g for s in sorted(self.steps) for g in self.steps[s]]

    def append(self, step: int, group_ids: list[int]) -> None:
        data = (json.dumps({"step": step, "groups": list(group_ids), "wall": round(time.time(), 3)}) + "\n").encode()
        append_whole(self._fd, data, self.path)
        self.steps[step] = list(group_ids)

    def sync(self) -> None:
        """Before a checkpoint is marked complete: the lines it relies on are on disk."""
        if self._fd is not None:
            with writing(self.path):
                os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
