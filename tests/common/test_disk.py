"""`common.disk`: a full disk said plainly (`OutOfDisk` names the path, the free bytes, what to free),
on a real filesystem filled to its last byte (a tmpfs; root)."""

from __future__ import annotations

import errno
import os

import pytest

from common.disk import RESERVE_ENV, OutOfDisk, is_disk_full, release_reserve, reserve, writing
from tests.helpers.disk import fill, free, tmpfs


@pytest.fixture
def disk(tmp_path):
    with tmpfs(tmp_path / "disk", 4) as d:
        yield d


def test_a_write_to_a_full_disk_raises_out_of_disk_naming_the_path(disk):
    fill(disk)
    target = disk / "run" / "metrics.jsonl"
    target.parent.mkdir()
    with pytest.raises(OutOfDisk) as e, writing(target), open(target, "wb", buffering=0) as f:
        f.write(b"x" * 8192)
    assert isinstance(e.value, OSError) and e.value.errno == errno.ENOSPC
    assert e.value.path == str(target) and e.value.free == free(disk) == 0
    text = str(e.value)
    assert str(target) in text and "0 bytes free" in text and str(disk) in text  # the filesystem's mount point
    assert "<run_dir>/checkpoints" in text and "learner.keep_checkpoints" in text


def test_other_errors_pass_through_and_a_library_saying_it_in_words_counts(disk):
    with pytest.raises(PermissionError), writing(disk / "x"):
        raise PermissionError(errno.EACCES, "denied")
    # safetensors keeps no errno, only the words
    assert is_disk_full(RuntimeError("I/O error: No space left on device (os error 28)"))
    assert not is_disk_full(RuntimeError("file write failed"))
    # torch.save says only "file write failed": counted as a full disk where one is nearly full
    with pytest.raises(RuntimeError), writing(disk / "x", nearly_full=True):
        raise RuntimeError("file write failed")
    fill(disk)
    with pytest.raises(OutOfDisk), writing(disk / "x", nearly_full=True):
        raise RuntimeError("file write failed")


def test_the_reserve_gives_back_room_for_the_last_words(disk, monkeypatch):
    monkeypatch.delenv(RESERVE_ENV, raising=False)
    assert reserve(disk / ".disk_reserve", 256 << 10)
    assert os.environ[RESERVE_ENV] == str(disk / ".disk_reserve")
    fill(disk)
    with pytest.raises(OSError), open(disk / "last_words", "wb", buffering=0) as f:
        f.write(b"x" * 1000)
    assert release_reserve() and not (disk / ".disk_reserve").exists()
    assert free(disk) >= 256 << 10
    (disk / "last_words").write_bytes(b"x" * 1000)
    assert not release_reserve()  # (once)
    (disk / "last_words").unlink()
    assert not reserve(disk / ".disk_reserve", 64 << 20) and not (disk / ".disk_reserve").exists()  # no room: none
