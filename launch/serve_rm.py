"""Reward model server: `python -m launch.serve_rm [CONFIG] [--serve_rm.key VALUE ...]`.

Serves a reward model folder over HTTP (actors/reward_server.py says the protocol): POST
/get_reward or /reward with OpenRLHF's `{"query", "prompts", "labels"}` or Conveyor's
`{"prompts", "completions", "labels"}`, concurrent requests scored together in batches. Reads section
`serve_rm:` of CONFIG; a key is also set as `--KEY VALUE`. It listens on 127.0.0.1 unless `--host`
says otherwise (OpenRLHF's default is 0.0.0.0); with a token (`--serve_rm.token`, or better the
environment variable CONVEYOR_RM_TOKEN) requests need `Authorization: Bearer <token>`. Example:

    python -m launch.serve_rm --serve_rm.model /tmp/rm --port 5000 --batch_size 16

OpenRLHF's `openrlhf.cli.serve_rm` command line works as it is, for example

    python -m launch.serve_rm --reward.model_name_or_path /tmp/rm --reward.normalize_enable \\
        --data.max_len 8192 --batch_size 16 --port 5000

Each of its flags (0.11.2's dotted names and the older underscore ones) is mapped onto a key,
accepted and ignored where it only changes speed, or refused with the reason (see below).
"""

from __future__ import annotations

import sys
import textwrap

from common.config import Alias, ConfigError, ignored, parse_bool
from launch.entry import role_main


def param_dtype(v: str) -> str:
    names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    if v not in names:
        raise ValueError(f"one of {', '.join(names)}")
    return names[v]


def refused(flag: str, why: str, harmless, read=str) -> Alias:
    """A flag with no counterpart here: at its OpenRLHF default `harmless` it changes nothing and is
    accepted; any other value stops the server at parse time with `why`."""
    def check(v: str):
        if read(v) != harmless:
            raise ConfigError(f"--{flag} {v}: {why}")
        return v

    return Alias(("extra.refused",), check, why)


class FlagTable(dict):
    """`{flag: Alias}` for the command line, which also writes its section of `--help`."""

    def describe(self) -> list[str]:
        lines = ["OpenRLHF's serve_rm flags (0.11.2 names and older ones):"]
        for flag, alias in self.items():
            if alias.targets == ("extra.refused",):
                meaning = f"refused unless at OpenRLHF's default: {alias.note}"
            elif alias.targets:
                meaning = "sets " + ", ".join(f"serve_rm.{t}" for t in alias.targets)
            else:
                meaning = f"accepted, no effect: {alias.note}"
            lines += [f"  --{flag}", *textwrap.wrap(meaning, 96, initial_indent=" " * 6, subsequent_indent=" " * 6)]
        return lines + ["  --port, --host, --batch_size, --max_len   the keys of the same name"]


_SPEED = "attention runs as the model folder's default; the scores agree up to rounding"
_HEAD = "the head is the sequence-classification model's own `score` layer"
# --port, --host and --batch_size (and the older --max_len) are keys of the section itself: same meaning
SERVE_RM_FLAGS = FlagTable({
    "reward.model_name_or_path": Alias(("model",)),
    "reward_pretrain": Alias(("model",)),
    "reward.normalize_enable": Alias(("normalize",), parse_bool),
    "normalize_reward": Alias(("normalize",), parse_bool),
    "data.max_len": Alias(("max_len",)),
    "ds.param_dtype": Alias(("dtype",), param_dtype),
    "model_data_type": Alias(("dtype",), param_dtype),
    "bf16": Alias(("dtype",), lambda v: "bfloat16" if parse_bool(v) else "float32"),
    "ds.attn_implementation": ignored(_SPEED),
    "attn_implementation": ignored(_SPEED),
    "flash_attn": ignored(_SPEED),
    "ds.experts_implementation": ignored("MoE experts run as transformers picks; the scores agree up to rounding"),
    "data.disable_fast_tokenizer": ignored("the tokenizer folder decides; slow and fast tokenizers give the same ids"),
    "disable_fast_tokenizer": ignored("the tokenizer folder decides; slow and fast tokenizers give the same ids"),
    "ds.packing_samples": ignored("texts are padded into one batch; packing changes the speed, not the scores"),
    "packing_samples": ignored("texts are padded into one batch; packing changes the speed, not the scores"),
    "ds.value_head_prefix": refused("ds.value_head_prefix", _HEAD, "score"),
    "value_head_prefix": refused("value_head_prefix", _HEAD, "score"),
    "ds.load_in_4bit": refused("ds.load_in_4bit", "4-bit quantised weights are not supported", False, parse_bool),
    "load_in_4bit": refused("load_in_4bit", "4-bit quantised weights are not supported", False, parse_bool),
    "use_ms": refused("use_ms", "ModelScope downloads are not supported: give a local folder", False, parse_bool),
})


def main(argv: list[str] | None = None) -> int:
    from actors.reward_server import RewardServerConfig

    return role_main("serve_rm", RewardServerConfig, "actors.reward_server:run", __doc__, argv,
                     aliases=SERVE_RM_FLAGS, failed=(OSError,))


if __name__ == "__main__":
    sys.exit(main())
