"""The run config's file and environment: secrets never reach a file (`launch.run_config.SECRETS`);
settings one role takes from another's (routing replay: the generators record routes)."""

from __future__ import annotations

import json

import pytest

from common.config import ConfigError
from launch.roles import RestartPolicy, plan
from launch.run_config import load_run_config, write_resolved
from tests.helpers.procs import ROOT

TOKEN = "s3cret-bearer-token"


def test_the_reward_token_reaches_the_scorers_by_environment_and_no_file(tiny_model_dir, tmp_path):
    from launch.local import device_plan

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    run = load_run_config(None, [f"--learner.model_path={tiny_model_dir}", f"--buffer.prompts={prompts}",
                                 "--scorer.remote_url=http://127.0.0.1:9/reward", f"--scorer.remote_token={TOKEN}",
                                 f"--scorer.reward_fn={ROOT}/examples/rewards/arithmetic.py", "--run.num_scorers=2",
                                 f"--run.run_dir={tmp_path / 'run'}"])
    assert run.scorer.remote_token == TOKEN  # the run itself has it
    path = write_resolved(run, tmp_path / "run" / "config.yaml")
    text = path.read_text()
    assert TOKEN not in text and "remote_token: ''" in text
    specs = {s.name: s for s in plan(run, "local", RestartPolicy(), device_plan(run))}
    assert [n for n, s in specs.items() if s.env.get("CONVEYOR_RM_TOKEN") == TOKEN] == ["scorer-0", "scorer-1"]
    # a role restarted from the file alone (the scorer reads the variable when the key is empty)
    reread = load_run_config(path, [])
    assert reread.scorer.remote_token == ""


def test_routing_replay_makes_the_generators_record_routes_and_refuses_episodes(tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    base = [f"--learner.model_path={tiny_model_dir}", f"--buffer.prompts={prompts}", f"--run.run_dir={tmp_path / 'r'}",
            f"--scorer.reward_fn={ROOT}/examples/rewards/arithmetic.py"]
    assert load_run_config(None, [*base, "--learner.routing_replay=rollout"]).generator.record_routes is True
    assert load_run_config(None, base).generator.record_routes is False
    # set explicitly: routes recorded (and measured) without replaying them
    assert load_run_config(None, [*base, "--generator.record_routes=true"]).learner.routing_replay == "off"
    with pytest.raises(ConfigError) as e:
        load_run_config(None, [*base, "--learner.routing_replay=rollout", "--generator.env=guess"])
    assert "single-turn" in str(e.value)
