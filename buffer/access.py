"""Who may ask the buffer what, when its sockets speak CurveZMQ (`common/curve.py`).

With CURVE on, a peer gets a connection only with one of the run's keys whose role may use that
socket (`SOCKET_ROLES`), and every request it sends carries its key's name. Then each request must
come from a role that makes it (`REQUEST_ROLES`): only the learner's ranks fetch batches, set the
version, resume or ask for an evaluation round; only generators lease; only scorers push scored
rollouts. And a lease belongs to the key that took it: a renewal, a given-up group or a relayed
rollout under a lease from any other key is refused, so one generator cannot fail, extend or answer
another's work (a lease the buffer restored after a restart belongs to the first key that uses it).
A refused request gets an `Error` reply naming `permission` (a relayed message is
dropped), counted in `buffer/refused_requests`.

With CURVE off (loopback, trusted) there is no identity and nothing is checked here.
"""

from __future__ import annotations

from collections import Counter

import msgspec

from buffer.groups import RequestError
from buffer.messages import (
    BatchRequest,
    EvalRequest,
    GroupFailed,
    LeaseGrant,
    LeaseRenew,
    LeaseRequest,
    MetricsRequest,
    Resume,
    SetVersion,
)
from common.curve import ROLES, role_refusal

SOCKET_ROLES = {"control": ROLES, "ingest": ("scorer",), "relay_in": ("generator",), "relay_out": ("scorer",)}
REQUEST_ROLES = {LeaseRequest: ("generator",), LeaseRenew: ("generator",), GroupFailed: ("generator",),
                 BatchRequest: ("learner",), SetVersion: ("learner",), Resume: ("learner",),
                 EvalRequest: ("learner",), MetricsRequest: ROLES, "scored": ("scorer",)}
OWNERS_KEPT = 4096  # lease owners remembered before the expired ones are forgotten


class _LeaseOf(msgspec.Struct):
    """The one field of a relayed rollout the check reads (the rest is the scorer's to check)."""

    lease_id: int = -1


_LEASE_OF = msgspec.msgpack.Decoder(_LeaseOf)


class Gate:
    """The checks above for one buffer; `live(lease_id)` says whether a lease is still held."""

    def __init__(self, live, counters: Counter):
        self.live = live
        self.counters = counters
        self.owners: dict[int, str] = {}  # lease id -> key name that took it

    def check(self, request, who: str | None) -> None:
        """Raise `RequestError` unless `who` may make `request` (a message, or "scored")."""
        kind = request if isinstance(request, str) else type(request)
        why = role_refusal(_name(request), who, REQUEST_ROLES.get(kind, ()))
        if why:
            self._refuse(why)
        lease_id = getattr(request, "lease_id", None)
        if lease_id is not None and isinstance(request, (LeaseRenew, GroupFailed)):
            owner = self._owner(lease_id, who)
            if owner != who:
                self._refuse(f"lease {lease_id} was granted to {owner}, not to {who}")

    def check_relay(self, frames, who: str | None) -> None:
        """Raise `RequestError` unless every rollout of a relayed `rollouts` message (its frames
        after the envelope) answers a lease granted to `who`: a generator pushes its own work only."""
        for i, f in enumerate(frames[1:]):
            try:
                lease_id = _LEASE_OF.decode(f).lease_id
            except (msgspec.DecodeError, RecursionError, ValueError):
                self._refuse(f"rollouts[{i}] cannot be read")
            owner = self._owner(lease_id, who)
            if owner != who:
                self._refuse(f"rollouts[{i}] answers lease {lease_id}, granted to {owner}, not to {who}")

    def _owner(self, lease_id: int, who: str | None) -> str | None:
        """The key a lease belongs to. A live lease with none recorded was granted before the
        buffer restarted (owners are not in the state log): the first generator key to use it
        takes it, so from then on it is checked like any other. A lease not live has no owner to
        protect: the buffer refuses its results on its own."""
        owner = self.owners.get(lease_id)
        if owner is None and who is not None and self.live(lease_id):
            owner = self.owners[lease_id] = who
        return who if owner is None else owner

    def granted(self, reply, who: str | None) -> None:
        if isinstance(reply, LeaseGrant) and who:
            self.owners[reply.lease_id] = who
            if len(self.owners) > OWNERS_KEPT:
                self.owners = {k: v for k, v in self.owners.items() if self.live(k)}

    def _refuse(self, why: str):
        self.counters["refused_requests"] += 1
        raise RequestError("permission", why)


def refused_peers(guard) -> dict:
    """The buffer's metrics of connections CURVE turned away, by socket (a key not of the run, of a
    role the socket is not for, or no CURVE at all); none with CURVE off (`guard` None)."""
    if guard is None:
        return {}
    refused = guard.refused
    return {"buffer/refused_peers": sum(refused[n] for n in SOCKET_ROLES),
            **{f"buffer/refused_peers_{n}": refused[n] for n in SOCKET_ROLES}}


def _name(request) -> str:
    return request if isinstance(request, str) else type(request).__name__
