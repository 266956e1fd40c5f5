"""A filesystem of its own for tests of a full disk: a tmpfs of a few MB (`tmpfs`, as root; the test
is skipped with the reason otherwise), filled by a ballast file (`fill`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

BALLAST = "ballast"


@contextmanager
def tmpfs(path: Path, size_mb: int) -> Iterator[Path]:
    """`path` as a tmpfs of `size_mb` MiB while the block runs (unmounted after, whatever is in it)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.strip() or done.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(folder: Path, leave: int = 0) -> Path:
    """A ballast file in `folder` that leaves `leave` bytes free on its filesystem (0: not one byte)."""
    ballast = folder / BALLAST
    with open(ballast, "ab", buffering=0) as f:
        for _ in range(50):  # (a run writing beside it may take some between the look and the allocation)
            size = shutil.disk_usage(folder).free - leave
            if size <= 0:
                break
            try:
                os.posix_fallocate(f.fileno(), os.fstat(f.fileno()).st_size, size)
                break
            except OSError:
                continue
        if leave == 0:  # what the blocks' rounding left
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
    return ballast


def free(folder: Path) -> int:
    return shutil.disk_usage(folder).free
