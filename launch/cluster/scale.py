"""`launch.ray scale`: the driver brings the number of generators to what the controller wants.

Scaling down stops the newest generators first: each gets SIGTERM, finishes the batch it is
generating and exits (its unanswered leases expire and the buffer issues them again); its bundle
is freed. Scaling up takes a free bundle of the generators' group, else places a new one-bundle
group (a short wait: the supervision loop is blocked meanwhile); a generator that does not fit is
refused with a message, the controller is told the count the run stays at, and the run goes on.
A new generator loads the learner's current weights before its first lease (actors/generator.py).

GPUs (launch/cluster/devices.py): in the separate layout a new generator's bundle reserves its own
generator.tensor_parallel_size GPUs, with the planned engines' memory share. In a colocated
layout the plan shared every GPU's memory out among the generators it planned: a new one can
only take the seat (devices, share) of a planned generator whose process has stopped; with none
free it is refused, saying so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from launch.cluster.config import ResourceError, check_resources
from launch.roles import State

if TYPE_CHECKING:
    from launch.cluster.run import RayRun

ACTIVE = (State.RUNNING, State.RESTARTING)


def active_generators(job: "RayRun") -> list:
    return [p for p in job.procs if p.spec.kind == "generator" and p.state in ACTIVE]


def seats_in_use(job: "RayRun") -> list[str]:
    """The planned generator seats a live process holds (NEW, RUNNING, RESTARTING or STOPPING)."""
    return [p.seat.role for p in job.procs if p.spec.kind == "generator" and p.seat is not None
            and p.state not in (State.DONE, State.STOPPED, State.FAILED)]


def scale_to(job: "RayRun", wanted: int) -> None:
    active = active_generators(job)
    if wanted == len(active):
        return
    if wanted < len(active):
        for p in active[wanted:]:  # the newest go first
            job.say(f"scale: stopping {p.name} (it finishes its batch; its leases go back to the buffer)")
            if p.actor is None:  # waiting for a new actor after its old one was lost
                p.state = State.STOPPED
                job.retire(p)
                continue
            p.state = State.STOPPING
            p.actor.stop.remote()
        return
    placement = job.placement
    for _ in range(wanted - len(active)):
        slot = None
        seat = job.devices.scale_seat(seats_in_use(job))
        if job.devices.seated("generator"):
            if seat is None:
                now = len(active_generators(job))
                job.ray.get(job.controller.scale.remote(now))
                job.say(f"scale: cannot add a generator: {job.devices.refuse_scale(now)}")
                return
            for old in [p for p in job.procs if p.seat is seat and p.actor is not None]:
                job.retire(old)  # (its process has exited; its actor still holds CPUs in the seat's bundle)
            slot = placement.seat_slot(seat)
        else:
            slot = placement.take_free("generator")
        try:
            if slot is None:
                b = placement.bundle("generator")
                if job.rcfg.check_resources:
                    check_resources([("generator", [b], "PACK")], placement.alive_nodes())
                group = placement.place("generator", [b], "PACK", min(30.0, job.rcfg.placement_timeout_s), keep=False)
                slot = placement.take(group)
            p = job.add_generator(slot, seat)
            job.start(p)
        except ResourceError as e:
            if slot is not None:
                placement.release(slot)
            now = len(active_generators(job))
            job.ray.get(job.controller.scale.remote(now))
            job.say(f"scale: cannot add a generator: {e}; staying at {now}")
            return
        job.say(f"scale: {p.name} started on {p.node['ip']} (pid {p.pid}); it catches up with the current "
                "weights before its first lease")
