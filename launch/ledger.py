"""Audit a run's data accounting: `python -m launch.ledger RUN_DIR [--state-dir DIR] [--json]`.

Every prompt group the buffer issued must end in exactly one place: trained in one step of the final
lineage (`<run_dir>/ledger.jsonl`, written by the learner), dropped with a counted reason (the
buffer's state log; a group dynamic sampling filtered for carrying no reward signal is one of
these), or still in flight (queued or to be issued again when the run goes on). The audit reads
both files and prints, as JSON:

    steps, missing_steps           learner steps in the ledger; steps 0..last that have no line
    groups_trained                 distinct groups trained
    groups_trained_twice           groups that appear in more than one step (must be 0)
    groups_dropped                 {reason: count}: dropped_stale, failed_groups, dropped_overflow, filtered
    groups_filtered                groups_dropped's `filtered`: no reward signal (buffer.dynamic_filtering)
    groups_in_flight               issued, neither trained nor dropped, held by the buffer to serve or issue again
    groups_lost                    issued and in none of the above (must be 0)

Exit code 0 when nothing was trained twice and nothing lost, 1 otherwise (2: no ledger).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path


def audit(run_dir: str | Path, state_dir: str | Path | None = None) -> dict:
    from buffer.store import LOG_NAME, StateStore
    from learner.ledger import LEDGER_NAME

    run_dir = Path(run_dir)
    rows: dict[int, list[int]] = {}
    seen_steps: Counter[int] = Counter()
    for line in (run_dir / LEDGER_NAME).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        seen_steps[int(row["step"])] += 1
        rows[int(row["step"])] = [int(g) for g in row["groups"]]
    times: Counter[int] = Counter(g for groups in rows.values() for g in groups)
    trained = set(times)
    last = max(rows, default=-1)
    out = {
        "steps": len(rows),
        "missing_steps": [s for s in range(last + 1) if s not in rows],
        "steps_written_twice": sorted(s for s, n in seen_steps.items() if n > 1),
        "groups_trained": len(trained),
        "groups_trained_twice": sum(1 for n in times.values() if n > 1),
    }
    log = Path(state_dir or run_dir / "buffer_state") / LOG_NAME
    if log.is_file():
        r = StateStore.read(log)
        dropped = {g: c for g, (c, _) in r.dropped.items() if g not in trained}
        in_flight = (set(r.groups) | set(r.open_groups)) - trained - set(dropped)
        issued = set(range(max(r.next_group, max(trained, default=-1) + 1)))
        out.update({
            "groups_issued": len(issued),
            "groups_dropped": dict(Counter(dropped.values())),
            "groups_filtered": sum(1 for c in dropped.values() if c == "filtered"),
            "groups_in_flight": len(in_flight),
            "groups_lost": len(issued - trained - set(dropped) - in_flight),
            "dropped_and_trained": sum(1 for g in r.dropped if g in trained),
        })
    return out


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    from launch.config import help_or_usage

    help_or_usage(argv, lambda: __doc__.strip())
    run_dir = argv.pop(0)
    state_dir = None
    if argv[:1] == ["--state-dir"] and len(argv) > 1:
        state_dir = argv[1]
    if not (Path(run_dir) / "ledger.jsonl").is_file():
        print(f"launch.ledger: {run_dir} has no ledger.jsonl (is it a run folder?)", file=sys.stderr)
        sys.exit(2)
    report = audit(run_dir, state_dir)
    print(json.dumps(report, indent=2))
    bad = report["groups_trained_twice"] or report.get("groups_lost") or report["missing_steps"]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
