"""The learner's writers on a full disk (a tmpfs filled by a ballast file; root): the ledger,
metrics.jsonl, tensorboard and a checkpoint each raise `common.disk.OutOfDisk` naming what they could
not write, and leave what was there before whole: a line is written entirely or not at all, and a
checkpoint save that fails midway leaves the previous checkpoint the latest, its own folder gone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from common.disk import OutOfDisk
from learner.ledger import Ledger, read_ledger
from learner.metrics import MetricsWriter, read_metrics
from tests.helpers.disk import fill, tmpfs
from tests.helpers.procs import subprocess_env


@pytest.fixture
def disk(tmp_path):
    with tmpfs(tmp_path / "disk", 4) as d:
        yield d


def test_the_ledger_on_a_full_disk(disk):
    ledger = Ledger(disk)
    ledger.start(0)
    ledger.append(0, [0, 1])
    ballast = fill(disk)
    with pytest.raises(OutOfDisk) as e:
        for step in range(1, 500):  # (the file's last page may take a few lines)
            ledger.append(step, list(range(100)))
    assert e.value.path == str(disk / "ledger.jsonl")
    lines = (disk / "ledger.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(len(lines)))  # whole lines only
    assert sorted(ledger.steps) == list(range(len(lines)))  # and it holds what the file holds
    # a resume's rewrite on the full disk leaves the ledger as it was
    before = (disk / "ledger.jsonl").read_bytes()
    ledger.close()
    with pytest.raises(OutOfDisk):
        Ledger(disk).start(len(lines))
    assert (disk / "ledger.jsonl").read_bytes() == before and not (disk / "ledger.jsonl.tmp").exists()
    ballast.unlink()
    again = Ledger(disk)
    again.start(len(lines))
    again.close()
    assert sorted(read_ledger(disk / "ledger.jsonl")) == list(range(len(lines)))


# (tensorboard's writer thread dies of the same full disk, and says so as it goes)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_metrics_and_tensorboard_on_a_full_disk(disk):
    writer = MetricsWriter(disk, tensorboard=False)
    writer.log(0, {"loss/policy": 1.0})
    fill(disk)
    with pytest.raises(OutOfDisk) as e:
        for step in range(1, 500):
            writer.log(step, {f"k{i}": float(i) for i in range(50)})
    writer.close()
    assert e.value.path == str(disk / "metrics.jsonl")
    rows = read_metrics(disk)  # (json.loads on every line: a torn one would fail here)
    assert [r["step"] for r in rows] == list(range(len(rows))) and rows[0]["loss/policy"] == 1.0

    (disk / "ballast").unlink()
    (disk / "metrics.jsonl").unlink()
    tb = MetricsWriter(disk, tensorboard=True)
    tb.log(0, {"loss/policy": 1.0})
    fill(disk, leave=64 << 10)  # room for metrics.jsonl's lines, not for the events
    with pytest.raises(OutOfDisk) as e:
        for step in range(1, 2000):
            tb.log(step, {f"k{i}": float(i) for i in range(50)})
    tb.close()  # (says what it could not write; raises nothing more)
    assert e.value.path in (str(disk / "tensorboard"), str(disk / "metrics.jsonl"))


DRIVER = r'''
import json, shutil, sys
from pathlib import Path
from common.disk import OutOfDisk
from learner.checkpoint import latest_checkpoint, list_checkpoints
from learner.config import LearnerConfig
from learner.trainer import train
from tests.helpers.disk import fill
from tests.helpers.learner import ListSource, make_group

model_dir, run_dir, fill_at = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
steps = {s: make_group(2 * s, 4, [1.0, 0.0, 0.5, 0.2], seed=s) + make_group(2 * s + 1, 4, [0.0, 1.0, 1.0, 0.3], seed=s)
         for s in range(4)}


class FillingSource(ListSource):
    """Fills the disk when asked for step `fill_at`, leaving half a checkpoint's room: the next save fails midway."""

    def get_batch(self, step, rank=0, world_size=1, timeout_s=None):
        if step == fill_at:
            size = sum(f.stat().st_size for f in (run_dir / "checkpoints" / "step_2").rglob("*") if f.is_file())
            print(json.dumps({"checkpoint_bytes": size}), flush=True)
            fill(run_dir.parent, leave=size // 2)
        return super().get_batch(step, rank, world_size, timeout_s)


cfg = LearnerConfig(model_path=model_dir, run_dir=str(run_dir), total_steps=4, save_every=2, resume=fill_at < 0,
                    advantage_estimator="grpo", lr=1e-3, zero_stage=2, tensorboard=False)
cfg.validate()
try:
    train(cfg, source=FillingSource(steps))
except OutOfDisk as e:
    print(json.dumps({"path": e.path, "latest": latest_checkpoint(run_dir).name,
                      "complete": [p.name for p in list_checkpoints(run_dir)],
                      "folders": sorted(p.name for p in (run_dir / "checkpoints").iterdir())}), flush=True)
    sys.exit(9)
'''


def _driver(driver, model, run_dir, fill_at: int) -> tuple[int, list[dict]]:
    env = subprocess_env()
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # a world of one
    p = subprocess.run([sys.executable, str(driver), str(model), str(run_dir), str(fill_at)], env=env,
                       capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert p.returncode in (0, 9), p.stdout[-2000:] + p.stderr[-4000:]
    return p.returncode, rows


@pytest.mark.slow
def test_a_checkpoint_save_that_meets_a_full_disk_leaves_the_previous_one_latest(tiny_model_dir, tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    with tmpfs(tmp_path / "disk", 48) as disk:
        run_dir = disk / "run"
        code, rows = _driver(driver, tiny_model_dir, run_dir, fill_at=3)
        assert code == 9, rows
        size, failed = rows[0]["checkpoint_bytes"], rows[-1]
        assert size > 1 << 20  # (half of it cannot hold the next one)
        # the save of step 4 failed midway: named, its folder removed, step 2 still the latest
        assert failed["path"] == str(run_dir / "checkpoints" / "step_4"), failed
        assert failed["latest"] == "step_2" and failed["complete"] == ["step_2"], failed
        assert "step_4" not in failed["folders"] and "latest.tmp" not in failed["folders"], failed
        assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]

        (disk / "ballast").unlink()
        code, _ = _driver(driver, tiny_model_dir, run_dir, fill_at=-1)  # resumed: from step_2
        assert code == 0
        assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 2, 3]
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_4"
        assert sorted(read_ledger(run_dir / "ledger.jsonl")) == [0, 1, 2, 3]
