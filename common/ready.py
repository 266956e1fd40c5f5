"""The explicit ready signal: a role says it is ready by writing a small JSON file, and the
launcher that started it waits for that file (never for a log line).

The launcher passes the path in `CONVEYOR_READY_FILE`; a role started by hand has none and
`mark_ready` does nothing. The file is written whole (temporary file, then rename), so a reader
never sees half of it. A role may write it again later to say more about itself (a generator
adds its counts as it goes and once more as it exits): the record is what the role last said,
and a launcher shows it in its status.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from common.disk import OutOfDisk, is_disk_full

ENV = "CONVEYOR_READY_FILE"


def mark_ready(role: str, **info) -> Path | None:
    """Write `{"role", "pid", "time", **info}` to the path in $CONVEYOR_READY_FILE, if there is one.

    On a full disk the first record raises `common.disk.OutOfDisk` (the role is not ready: it exits
    with the disk's code); a later one, which only updates what the role says of itself, is skipped
    (returns None) and the last whole record stays."""
    path = os.environ.get(ENV)
    if not path:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"role": role, "pid": os.getpid(), "time": time.time(), **info}))
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if not is_disk_full(e):
            raise
        if not path.exists():
            raise OutOfDisk(path) from e
        return None
    return path


def read_ready(path: str | os.PathLike) -> dict | None:
    """The ready record at `path`, or None while there is none."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
