"""The ready file on a full disk: the first record cannot be written -> OutOfDisk (the role exits
with the disk's code); a later update is skipped and the last whole record stays."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from common.disk import OutOfDisk
from common.ready import ENV, mark_ready, read_ready


def full_disk(monkeypatch):
    def refuse(self, *a, **kw):
        Path.write_bytes(self, b"{")  # (a torn temporary file, as a write cut short leaves one)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", refuse)


def test_a_full_disk_before_the_first_record_is_out_of_disk(tmp_path, monkeypatch):
    path = tmp_path / "ready" / "generator-0.json"
    monkeypatch.setenv(ENV, str(path))
    full_disk(monkeypatch)
    with pytest.raises(OutOfDisk, match="out of disk space writing .*generator-0.json"):
        mark_ready("generator", samples=0)
    assert not path.exists() and list(path.parent.iterdir()) == []  # no temporary file left


def test_a_full_disk_skips_an_update_and_keeps_the_last_record(tmp_path, monkeypatch):
    path = tmp_path / "generator-0.json"
    monkeypatch.setenv(ENV, str(path))
    assert mark_ready("generator", samples=8) == path
    full_disk(monkeypatch)
    assert mark_ready("generator", samples=16) is None
    assert read_ready(path)["samples"] == 8 and list(tmp_path.iterdir()) == [path]


def test_another_error_is_raised_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "r.json"))

    def denied(self, *a, **kw):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(Path, "write_text", denied)
    with pytest.raises(PermissionError):
        mark_ready("buffer")
