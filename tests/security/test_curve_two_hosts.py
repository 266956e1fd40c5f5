"""CurveZMQ off loopback: a buffer on host A (a network namespace, scripts/netns.py) binds A's address,
so `buffer.curve auto` turns CURVE on; from host B, a client with the run's scorer key is served,
one with no keys and one with another run's keys get no answer, and the buffer counts both.

The loopback tests (tests/security/test_curve.py) force CURVE on with `curve on`; this is the case `auto`
exists for, with the peers really on another host. Skipped, with the reason, where namespaces
cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from common import curve
from scripts.netns import TwoNodes, unavailable
from tests.helpers.procs import ROOT

WHY = unavailable()
pytestmark = pytest.mark.skipif(bool(WHY), reason=WHY or "")
PORT = 5700  # free: the namespace is ours alone

ASK = """
import json, sys
from buffer.client import BufferClient
c = BufferClient(sys.argv[1], int(sys.argv[2]), timeout_s=3)
try:
    print(json.dumps({"metrics": c.metrics()}))
except TimeoutError as e:
    print(json.dumps({"timeout": str(e)}))
"""


def _ask(nodes: TwoNodes, keys, name: str | None) -> dict:
    env = {k: v for k, v in _env().items() if k not in (curve.KEYS_ENV, curve.NAME_ENV)}
    if keys is not None:
        env.update({curve.KEYS_ENV: str(keys), curve.NAME_ENV: name})
    out = subprocess.run(nodes.exec_argv("b", [sys.executable, "-c", ASK, nodes.addr["a"], str(PORT)]),
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _env() -> dict:
    from scripts.netns import ray_env

    return ray_env()


def test_curve_auto_is_on_across_hosts_and_admits_only_the_runs_keys(tmp_path):
    keys = curve.make_keys(tmp_path / "run" / "keys")
    other = curve.make_keys(tmp_path / "other" / "keys")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(8)))
    with TwoNodes(tag=str(40_000 + PORT)) as nodes:  # (entering makes the namespaces and the link)
        env = {**_env(), curve.KEYS_ENV: str(keys), curve.NAME_ENV: "buffer"}
        log = tmp_path / "buffer.log"
        buffer = nodes.popen("a", [sys.executable, "-m", "launch.buffer", "--buffer.host", nodes.addr["a"],
                                   "--buffer.port", str(PORT), "--buffer.prompts", str(prompts),
                                   "--buffer.curve", "auto"], log, env=env, cwd=ROOT)
        served = {}
        deadline = time.monotonic() + 60
        while "metrics" not in served and time.monotonic() < deadline and buffer.poll() is None:
            served = _ask(nodes, keys, "scorer")  # (again until its sockets are bound)
        assert "metrics" in served, (served, log.read_text()[-2000:])
        assert "timeout" in _ask(nodes, None, None)  # no keys: no CURVE handshake, no answer
        assert "timeout" in _ask(nodes, other, "scorer")  # another run's keys: refused by ZAP
        after = _ask(nodes, keys, "scorer")["metrics"]
        assert after["buffer/refused_peers_control"] >= 2, after
        buffer.terminate()
        assert buffer.wait(30) == 0, log.read_text()[-2000:]
    assert not nodes.leftovers()
