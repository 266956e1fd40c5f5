"""Every entry point answers `--help` without importing the heavy libraries (so at once), through
launch/entry.py's one helper for the roles, and every role module has the one contract `run(cfg, stop=None)`."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

from tests.helpers.procs import ROOT, subprocess_env

ENTRY_POINTS = ["buffer", "weight_sync", "generator", "scorer", "learner", "sft", "dpo", "rm", "local", "demo", "ray",
                "train_ppo_ray", "keys", "ledger", "serve_rm", "lora_combiner"]
HEAVY = ("torch", "vllm", "deepspeed", "ray", "transformers")
ROLES = ["buffer.service", "weight_sync.service", "actors.generator", "actors.scorer", "learner.trainer",
         "learner.offline.sft", "learner.offline.dpo", "learner.offline.rm", "actors.reward_server"]


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help_imports_no_heavy_library(name):
    probe = (f"import sys\nfrom launch.{name} import main\n"
             f"try:\n    code = main(['--help'])\nexcept SystemExit as e:\n    code = e.code\n"
             f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))\nsys.exit(code or 0)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HEAVY []" in out.stdout, out.stdout[-500:]
    assert len(out.stdout.splitlines()) > 3  # a usage, not an empty answer


@pytest.mark.parametrize("module", ROLES)
def test_every_role_has_the_one_contract(module):
    run = importlib.import_module(module).run
    params = inspect.signature(run).parameters
    assert list(params)[:2] == ["cfg", "stop"] and params["stop"].default is None, params
