"""Per-step metrics of every learner (RL and offline): the mean over ranks, and the writer.

Each rank builds the same keys; `reduce_across_ranks` turns them into the step's values, and rank 0
writes them: tensorboard under the run folder, one JSON line per step, wandb when asked for. Names
are grouped by prefix (`loss/`, `policy/`, `buffer/`, `optim/`, `perf/`, `time/`), so tensorboard
shows one section per prefix. Light: torch is imported only by the functions that reduce.
A full disk raises `common.disk.OutOfDisk` naming metrics.jsonl (a line that cannot be written whole
is cut off again) or the tensorboard folder.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from common.disk import append_whole, writing

# summed over ranks (every other key is a mean, or a min / max by its suffix)
SUMMED = ("perf/tokens", "perf/samples")
# key prefixes a rank may lack (the extra logs its share's reward answers carried): the mean over the ranks that
# have each, gathered as objects, in a step whose ranks have any
VARYING = ("reward/extra/", "task/")
_RANKS_WITH_VARYING = "_ranks_with_varying"


def reduce_across_ranks(metrics: dict[str, float], device, copies: int = 1) -> dict[str, float]:
    """Mean over ranks; `*_min` keys take the min, `*_max` the max, the keys in SUMMED the sum (of
    each share once: `copies` ranks hold each, a sequence-parallel group).

    Collective: every rank must pass the same keys (the loops build them the same way on each), but
    for those under a VARYING prefix, each the mean over the ranks that have it.
    """
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    if world == 1:
        return dict(metrics)
    varying = {k: v for k, v in metrics.items() if k.startswith(VARYING)}
    metrics = {k: v for k, v in metrics.items() if k not in varying} | {_RANKS_WITH_VARYING: float(bool(varying))}
    keys = sorted(metrics)
    groups = {"min": [k for k in keys if k.endswith("_min")], "max": [k for k in keys if k.endswith("_max")]}
    groups["sum"] = [k for k in keys if k in SUMMED or k == _RANKS_WITH_VARYING]
    taken = set(groups["min"]) | set(groups["max"]) | set(groups["sum"])
    groups["mean"] = [k for k in keys if k not in taken]
    ops = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM}
    out = {}
    for kind, ks in groups.items():
        if not ks:
            continue
        t = torch.tensor([metrics[k] for k in ks], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=ops[kind])
        if kind == "mean":
            t = t / world
        elif kind == "sum" and copies > 1:
            t = t / copies
        out.update(zip(ks, t.tolist()))
    if out.pop(_RANKS_WITH_VARYING):  # every rank knows whether any has such keys: all gather, or none
        shares: list = [None] * world
        dist.all_gather_object(shares, varying)
        for k in sorted({k for share in shares for k in share}):
            values = [share[k] for share in shares if k in share]
            out[k] = sum(values) / len(values)
    return out


def config_dict(cfg) -> dict[str, Any]:
    """A config section as plain values (for wandb's run config)."""
    if hasattr(cfg, "model_dump"):
        return cfg.model_dump()
    return dataclasses.asdict(cfg)


class MetricsWriter:
    """Writes `<run_dir>/metrics.jsonl` (appended, so a resumed run continues the same file),
    tensorboard events under `<run_dir>/tensorboard/`, and wandb if `wandb_project` is set and
    wandb is importable."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, wandb_project: str = "",
                 config: dict[str, Any] | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        # appended to unbuffered: a line that fails is cut off, never left to a later flush
        self._jsonl: int | None = os.open(self.jsonl_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
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
        data = (json.dumps({"step": step, "time": time.time(), **{k: v if math.isfinite(v) else None
                                                                  for k, v in clean.items()}}) + "\n").encode()
        append_whole(self._jsonl, data, self.jsonl_path)
        if self._tb is not None:
            with writing(self.run_dir / "tensorboard"):
                for k, v in clean.items():
                    self._tb.add_scalar(k, v, step)
                self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    @classmethod
    def for_run(cls, run_dir: str | Path, cfg) -> "MetricsWriter":
        """The writer a learner config asks for (its `tensorboard` and `wandb_project`)."""
        return cls(run_dir, cfg.tensorboard, cfg.wandb_project, config=config_dict(cfg))

    def close(self) -> None:
        if self._jsonl is None:
            return
        os.close(self._jsonl)
        self._jsonl = None
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError as e:  # (what it could not write, `log` raised already, or says here)
                print(f"learner: tensorboard events under {self.run_dir / 'tensorboard'} not all written: {e}",
                      file=sys.stderr)
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The lines of `<run_dir>/metrics.jsonl`, in order (for tests and plots)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
