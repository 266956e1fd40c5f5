"""A remote reward server in OpenRLHF's protocol, run as a process of its own:

    python -m tests.helpers.reward_server READY_FILE [N_PORTS]

listens on N_PORTS ports (default 1) that the system picks and writes them to READY_FILE as JSON
(`{"ports": [...]}`) once every one answers. Each port answers

    POST /get_reward  {"query": [...], "prompts": [...], "labels": [...]}
        -> {"rewards": [1.0 if the query ends with its label else 0.0, ...],
            "scores": [len(query) % 2, ...], "extra_logs": {"port": [port, ...], "query_len": [len(query), ...]}}
    POST /bad         400 (a request the server refuses: must not be retried)
    GET  /stats       {"<path>": requests to it, ...} over all ports

(`extra_logs.port` tells which URL scored which sample.) `start_reward_server` starts one for a test.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.helpers.procs import ROOT, subprocess_env

REQUESTS: Counter = Counter()


class Handler(BaseHTTPRequestHandler):
    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200, dict(REQUESTS)) if self.path == "/stats" else self._send(404, {"error": self.path})

    def do_POST(self):
        REQUESTS[self.path] += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/get_reward":
            self._send(400, {"error": f"no such endpoint {self.path}"})
            return
        queries, labels = body["query"], body["labels"]
        port = self.server.server_address[1]
        rewards = [float(label is not None and q.endswith(label)) for q, label in zip(queries, labels)]
        self._send(200, {"rewards": rewards,
                         "scores": [float(len(q) % 2) for q in queries],
                         "extra_logs": {"port": [port] * len(queries), "query_len": [len(q) for q in queries]}})

    def log_message(self, *args):
        pass


def serve(ready_file: Path, n_ports: int) -> None:
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(n_ports)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    tmp = ready_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"ports": [s.server_address[1] for s in servers]}))
    tmp.rename(ready_file)  # whole, or not there
    threading.Event().wait()  # until killed


def start_reward_server(tmp_path: Path, n_ports: int = 1, timeout_s: float = 30.0
                        ) -> tuple[subprocess.Popen, list[int]]:
    """The server as a process, and its ports once it listens on them."""
    ready = tmp_path / "reward_server.json"
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.reward_server", str(ready), str(n_ports)],
                            cwd=ROOT, env=subprocess_env())
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the reward server did not start (exit code {proc.poll()})")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())["ports"]


if __name__ == "__main__":
    serve(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1)
