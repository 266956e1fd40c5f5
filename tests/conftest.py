"""Fixtures shared by the whole suite: the tiny model folder (and a reward model of its shape), free ports.

Expensive things are built once per session (the tiny model) so that the suite stays within its
time budget on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from launch.ports import free_port_block  # noqa: E402

# vLLM on CPU: the KV cache is host memory; 1 GiB is plenty for the tiny model.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The default tiny Llama (2 layers, hidden 128, head_dim 64) and its character tokenizer."""
    from demo.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory) -> Path:
    """The tiny Qwen2-VL (demo/tiny_vlm.py) with its processor; read-only for the tests that share it."""
    from demo.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model", seed=0)


@pytest.fixture(scope="session")
def quick_start_files(tiny_model_dir, tmp_path_factory):
    """The tiny policy, a reward model of its shape (a sequence-classification head, seeded), and
    16 arithmetic prompts under both OpenRLHF's default key (`input`) and Conveyor's (`prompt`)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from demo.arithmetic import make_problems

    out = tmp_path_factory.mktemp("quick_start")
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    cfg.num_labels = 1
    torch.manual_seed(1)
    cfg.mean, cfg.std = 0.1, 2.0  # as OpenRLHF's reward model training stores them (--normalize_reward)
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(out / "rm")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out / "rm")
    rows = make_problems(16, seed=3)
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": r["prompt"], "prompt": r["prompt"], "label": r["label"]}) + "\n"
                               for r in rows))
    return {"model": str(tiny_model_dir), "rm": str(out / "rm"), "prompts": str(prompts), "dir": out}


@pytest.fixture
def weight_sync_service():
    """A live weight-sync service on a free port (stale_after_s 60): (service, port)."""
    from weight_sync.config import WeightSyncConfig
    from weight_sync.service import WeightSyncService

    port = free_port_block(1)
    svc = WeightSyncService(WeightSyncConfig(port=port, stale_after_s=60))
    svc.start()
    yield svc, port
    svc.stop()


# On two workers (pytest-xdist, `make test PYTEST_WORKERS="-n 2"`) the suite is scheduled a module at a time: a module's
# tests stay together on one worker, so a module-scoped run (tests/system/test_e2e.py's) is made
# once, and the modules that start a Ray cluster or network namespaces are one unit, so that no two of
# them run at once. (xdist's own `--dist loadgroup` does not group under pytest 9: it renames items
# through an attribute pytest no longer reads.)
ONE_AT_A_TIME = {"test_two_node.py", "test_ray_devices.py", "test_ray_launcher.py", "test_openrlhf_cli.py",
                 "test_curve_two_hosts.py", "test_network_faults.py", "test_link.py"}


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "cluster" if Path(module).name in ONE_AT_A_TIME else module

    return ByModule(config, log)
