"""The buffer's state log under each `buffer.fsync` policy: what durability costs, side by side.

    .venv/bin/python bench/state_log.py [--records 2000] [--kib 12] [--dir runs/bench_state_log]

Appends `--records` group records of `--kib` KiB each (a group of scored rollouts) through
`buffer.store.StateStore`, with a loop pass (`flush`) every 8 records as the buffer's loop does
under load, for fsync = never, batch, record and 0.1 s. Prints one JSON line last: records/s per
policy and each policy's cost relative to `never`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=2000)
    ap.add_argument("--kib", type=int, default=12)
    ap.add_argument("--dir", default=str(ROOT / "runs" / "bench_state_log"))
    args = ap.parse_args()
    from buffer.store import StateStore

    frames = [bytes(args.kib * 1024 // 8)] * 8
    out = {}
    for policy in ("never", "batch", "record", "0.1"):
        d = Path(args.dir) / policy
        shutil.rmtree(d, ignore_errors=True)
        store = StateStore(str(d), fsync=policy, compact_bytes=1 << 40)
        store.open()
        t0 = time.perf_counter()
        for i in range(args.records):
            store.group(i, frames)
            if i % 8 == 7:
                store.flush()
        store.close()
        dt = time.perf_counter() - t0
        out[policy] = round(args.records / dt, 1)
        print(f"[bench] fsync={policy}: {out[policy]:.0f} records/s", file=sys.stderr, flush=True)
    print(json.dumps({"records_per_s": out,
                      "slowdown_vs_never": {k: round(out["never"] / v, 2) for k, v in out.items()},
                      "record_kib": args.kib, "records": args.records}))


if __name__ == "__main__":
    main()
