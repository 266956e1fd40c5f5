"""Per-step metrics: tensorboard under the run folder, one JSON line per step, wandb when asked for.

Only rank 0 writes; names are grouped by prefix (`loss/`, `policy/`, `buffer/`, `optim/`, `perf/`,
`time/`), so tensorboard shows one section per prefix.
"""

from __future__ import annotations

import json
import math
import time
import sys
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Writes `<run_dir>/metrics.jsonl` (appended, so a resumed run continues the same file),
    tensorboard events under `<run_dir>/tensorboard/`, and wandb if `wandb_project` is set and
    wandb is importable."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, wandb_project: str = "",
                 config: dict[str, Any] | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        self._wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError:
                print(f"learner: wandb_project={wandb_project!r} but wandb is not installed; "
                      f"logging to tensorboard and metrics.jsonl only", file=sys.stderr)
            else:
                self._wandb = wandb.init(project=wandb_project, config=config or {},
                                         dir=str(self.run_dir), resume="allow")

    def log(self, step: int, values: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in sorted(values.items())}
        # JSON has no NaN/inf: they become null (e.g. the grad norm when DeepSpeed does not compute it)
        # `time`: wall clock when the step was logged (for throughput to K steps across runs)
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **{k: v if math.isfinite(v) else None
                                                       for k, v in clean.items()}}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The lines of `<run_dir>/metrics.jsonl`, in order (for tests and plots)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
