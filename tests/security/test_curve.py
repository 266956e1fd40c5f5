"""CurveZMQ on the buffer and the weight-sync service: only the run's keys connect, and each role
may ask only what it asks in a run (common/curve.py, buffer/access.py).

The buffer is a real process (`python -m launch.buffer --buffer.curve on`, on loopback, where
CURVE is otherwise off); clients are the project's own, each given its identity as a launched role
is (CONVEYOR_KEYS and CONVEYOR_KEY_NAME in the environment when it is made).
"""

import os
import stat
import time

import pytest
import zmq

from buffer.client import BufferClient, BufferError
from buffer.messages import LeaseGrant
from common import curve
from launch.ports import free_port_block
from tests.helpers.buffer import scored, start_buffer
from weight_sync.client import GeneratorSyncClient, WeightSyncError
from weight_sync.config import WeightSyncConfig
from weight_sync.service import WeightSyncService


def client_as(monkeypatch, keys, name: str | None, port: int, timeout_s: float = 5.0) -> BufferClient:
    """A BufferClient holding key `name` of the folder `keys` (None: no keys at all)."""
    if keys is None:
        monkeypatch.delenv(curve.KEYS_ENV, raising=False)
    else:
        monkeypatch.setenv(curve.KEYS_ENV, str(keys))
        monkeypatch.setenv(curve.NAME_ENV, name)
    return BufferClient(port=port, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return curve.make_keys(tmp_path_factory.mktemp("run") / "keys")


def test_the_key_folder_is_private_and_a_shared_one_is_refused(keys, tmp_path, monkeypatch):
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for name in ("server", "learner", "scorer", "admin"):
        assert stat.S_IMODE((keys / f"{name}.secret").stat().st_mode) == 0o600
    again = curve.make_keys(keys)  # a resumed run keeps its keys
    assert (again / "server.secret").read_bytes() == (keys / "server.secret").read_bytes()
    shared = curve.make_keys(tmp_path / "shared")
    os.chmod(shared, 0o755)
    monkeypatch.setenv(curve.KEYS_ENV, str(shared))
    with pytest.raises(curve.KeyFolderError, match="readable by others"):
        curve.keys_folder()
    assert curve.role_of("gen-3") == "generator" and curve.role_of("learner") == "learner"
    assert curve.role_of("mallory") is None


def test_auto_is_on_off_loopback_and_a_service_without_keys_refuses_to_start(tmp_path, monkeypatch):
    assert not curve.curve_on("auto", "127.0.0.1") and not curve.curve_on("auto", "localhost")
    assert curve.curve_on("auto", "0.0.0.0") and curve.curve_on("auto", "10.1.2.3") and curve.curve_on("on", "::1")
    monkeypatch.delenv(curve.KEYS_ENV, raising=False)
    with pytest.raises(RuntimeError, match="did not start") as e:
        start_buffer(tmp_path, host="0.0.0.0")
    assert "launch.keys" in str(e.value) and "not loopback" in str(e.value)


def test_buffer_with_curve_admits_the_runs_keys_and_each_role_its_own_requests(keys, tmp_path, monkeypatch):
    monkeypatch.setenv(curve.KEYS_ENV, str(keys))
    buf = start_buffer(tmp_path, curve="on", prompts_per_step=2, n_samples_per_prompt=2, max_staleness=1)
    stranger_keys = curve.make_keys(tmp_path / "other_run" / "keys")  # same names, another run
    try:
        gen0 = client_as(monkeypatch, keys, "gen-0", buf.port)
        grant = gen0.lease("gen-0", max_groups=1)
        assert isinstance(grant, LeaseGrant)

        # no keys, or another run's: no connection, so no reply at all (and the refusal is counted)
        for who in (client_as(monkeypatch, None, None, buf.port, 1.0),
                    client_as(monkeypatch, stranger_keys, "gen-0", buf.port, 1.0)):
            with pytest.raises(TimeoutError):
                who.lease("gen-0")
            who.close()
        # a stranger's scored rollouts with reward 1000 on ingest never arrive
        stranger = client_as(monkeypatch, stranger_keys, "scorer", buf.port)
        stranger.push_scored([scored(g.group_id, i, grant.lease_id, reward=1000.0)
                              for g in grant.groups for i in range(2)])

        # the run's keys, but the wrong role or someone else's lease: an error naming `permission`
        scorer = client_as(monkeypatch, keys, "scorer", buf.port)
        with pytest.raises(BufferError, match="permission"):
            scorer.set_version(10 ** 9)
        gen1 = client_as(monkeypatch, keys, "gen-1", buf.port)
        with pytest.raises(BufferError, match="granted to gen-0"):
            gen1.renew(grant.lease_id)
        with pytest.raises(BufferError, match="permission"):
            gen1.group_failed(grant.lease_id, grant.groups[0].group_id, "not mine")
        assert gen0.renew(grant.lease_id).accepted == 1  # its owner still can
        learner = client_as(monkeypatch, keys, "learner", buf.port)
        assert learner.set_version(0).accepted == 1

        # raw rollouts under gen-0's lease: relayed to the scorer from gen-0 only
        own = [scored(g.group_id, i, grant.lease_id).rollout for g in grant.groups for i in range(2)]
        gen1.push_rollouts([scored(g.group_id, 0, grant.lease_id).rollout for g in grant.groups])
        gen0.push_rollouts(own)
        got, deadline = [], time.monotonic() + 5
        while len(got) < len(own) and time.monotonic() < deadline:
            got += scorer.pull_rollouts(timeout_s=0.5)
        assert len(got) == len(own) and scorer.pull_rollouts(timeout_s=0.5) == []

        time.sleep(0.5)
        m = client_as(monkeypatch, keys, "admin", buf.port).metrics()
        assert m["buffer/accepted_rollouts"] == 0  # nothing of the stranger's reached the buffer
        assert m["buffer/refused_requests"] == 4
        assert m["buffer/refused_peers_control"] >= 2 and m["buffer/refused_peers_ingest"] >= 1
        # the scorer, with the run's key, is heard on ingest
        scorer.push_scored([scored(g.group_id, i, grant.lease_id) for g in grant.groups for i in range(2)])
        deadline = time.monotonic() + 5
        while learner.metrics()["buffer/accepted_rollouts"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert learner.metrics()["buffer/accepted_rollouts"] == 2
    finally:
        assert buf.stop() == 0


def test_weight_sync_with_curve_refuses_strangers_and_impostors(keys, tmp_path, monkeypatch):
    monkeypatch.setenv(curve.KEYS_ENV, str(keys))
    ctx = zmq.Context()
    service = WeightSyncService(WeightSyncConfig(port=free_port_block(1), curve="on"), context=ctx)
    service.start()
    port = service.cfg.port

    def sync_client(folder, name, timeout_s=5.0):
        monkeypatch.setenv(curve.KEYS_ENV, str(folder))
        monkeypatch.setenv(curve.NAME_ENV, name)
        return GeneratorSyncClient(port=port, worker_id=name, timeout_s=timeout_s)

    try:
        assert sync_client(keys, "gen-0").register("vllm")["current_version"] == -1
        with pytest.raises(TimeoutError):
            sync_client(curve.make_keys(tmp_path / "other" / "keys"), "gen-0", 1.0).register("vllm")
        impostor = sync_client(keys, "gen-1")
        impostor.worker_id = "gen-0"  # speaks for gen-0 with its own key
        with pytest.raises(WeightSyncError, match="permission"):
            impostor.register("vllm")
        assert service.state.counts["refused_requests"] == 1
        assert service.guard.refused["weight_sync"] >= 1
    finally:
        service.stop()
        time.sleep(0.2)
        ctx.term()


def test_a_lease_restored_after_a_restart_belongs_to_the_first_key_that_uses_it():
    """Owners are not in the state log: a live lease with none recorded (granted before the buffer
    restarted) is taken by the first generator key that renews, fails or answers it; then it is
    checked as any lease; a lease not live has no owner to take."""
    from collections import Counter

    from buffer.access import Gate
    from buffer.groups import RequestError
    from buffer.messages import LeaseRenew

    live = {7}
    gate = Gate(lambda lease_id: lease_id in live, Counter())
    gate.check(LeaseRenew(7), "gen-1")  # the first use after the restart: gen-1 takes lease 7
    assert gate.owners == {7: "gen-1"}
    with pytest.raises(RequestError, match="granted to gen-1, not to gen-2"):
        gate.check(LeaseRenew(7), "gen-2")
    gate.check(LeaseRenew(8), "gen-2")  # not live: nothing recorded (the buffer refuses it itself)
    assert 8 not in gate.owners and gate.counters["refused_requests"] == 1


def test_a_rebound_socket_leaves_no_monitor_pipe_behind(keys):
    """The buffer's memory guard closes and rebinds its sockets; each closed socket's monitor pipe
    is closed too (MONITOR_STOPPED), so resets leak nothing."""
    from common.zap import Guard

    ctx = zmq.Context()
    guard = Guard(ctx, keys)
    try:
        for _ in range(10):
            s = guard.secure(ctx.socket(zmq.PULL), "ingest", ("scorer",))
            s.bind("tcp://127.0.0.1:0")
            s.close(0)
        kept = guard.secure(ctx.socket(zmq.PULL), "ingest", ("scorer",))
        kept.bind("tcp://127.0.0.1:0")
        deadline = time.monotonic() + 10
        while guard.watcher.pipes != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert guard.watcher.pipes == 1
        kept.close(0)
    finally:
        guard.close()
        ctx.term()
