"""The run's device plan as both launchers use it (launch/devices/plan.py holds the plan itself):
`device_plan` makes it, a layout that cannot fit being a `ConfigError` with the numbers, and
`print_plan` is `--plan`: the plan's table and what every role process gets, then exit. Nothing
is started or written (no keys, no run folder), so it answers on a laptop for an 8-GPU node
(`CONVEYOR_FAKE_GPUS=8`) or two of them (`=2x8`).
"""

from __future__ import annotations

import sys
from typing import Callable

from launch.devices.gpus import PlanError
from launch.devices.plan import plan_run
from launch.recovery import EXIT_CODES


def device_plan(run, nodes=None):
    """The run's device plan on `nodes` (None: this machine's, launch/devices/gpus.py `local_gpus`); a
    layout that cannot fit is a `ConfigError` with the numbers."""
    from common.config import ConfigError

    try:
        return plan_run(run, nodes)
    except PlanError as e:
        raise ConfigError(str(e)) from None


def local_environment(devices, specs) -> list[str]:
    """launch.local's lines: each process's CUDA_VISIBLE_DEVICES, memory cap and engine share."""
    if devices.layout == "cpu":
        return []
    lines = ["  environment:"]
    for spec in specs:
        extra = {k: v for k, v in spec.env.items() if k.startswith(("CUDA_", "CONVEYOR_CUDA"))}
        flags = " ".join(devices.overrides(spec.name))
        lines.append(f"    {spec.name:<13} " + " ".join(f"{k}={v}" for k, v in extra.items())
                     + (f" {flags}" if flags else ""))
    return lines


def print_plan(run, prog: str, launcher: str = "local", nodes=None,
               environment: Callable[[object, list], list[str]] | None = None) -> int:
    """`--plan`: the device plan as a table, then what each of `launcher`'s role processes gets
    (`environment(plan, specs)`, which may refuse with a `ConfigError`; default: launch.local's);
    0, or the config error code with the numbers when the run does not fit."""
    from common.config import ConfigError
    from launch.roles import RestartPolicy, plan

    try:
        devices = device_plan(run, nodes)
        lines = (environment or local_environment)(devices, plan(run, launcher, RestartPolicy(), devices))
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_CODES["config"]
    print(devices.table(), end="")
    for line in lines:
        print(line)
    return 0
