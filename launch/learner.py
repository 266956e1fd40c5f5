"""Learner ranks: `python -m launch.learner [CONFIG] [--learner.KEY VALUE ...]`.

One process per rank; start several with either launcher (both checked on CPU with gloo):

    deepspeed --num_gpus 2 --module launch.learner run.yaml --learner.zero_stage 3
    torchrun --nproc_per_node 2 -m launch.learner run.yaml --learner.zero_stage 3

Plain `python -m launch.learner` is a world of one. The buffer address defaults to the `buffer:`
section of the same file. Rank 0 prints a line starting `learner ready` once the engine is built.
"""

from __future__ import annotations

import sys


def field_docs() -> list[tuple[str, str, str]]:
    """(name, default, docstring) of LearnerConfig's fields, read from its source (no torch import)."""
    import ast
    import inspect

    from learner import config as mod

    tree = ast.parse(inspect.getsource(mod))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LearnerConfig")
    out, body = [], cls.body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = ""
            if i + 1 < len(body) and isinstance(body[i + 1], ast.Expr) and isinstance(body[i + 1].value, ast.Constant):
                doc = " ".join(str(body[i + 1].value.value).split())
            default = ast.unparse(node.value) if node.value is not None else ""
            out.append((node.target.id, default, doc))
    return out


def main(argv: list[str] | None = None) -> None:
    from launch.config import ConfigError, load_section

    from learner.config import LearnerConfig

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\nKeys of the `learner:` section (override as --learner.KEY VALUE):\n")
        for name, default, doc in field_docs():
            print(f"  {name} = {default}\n      {doc}")
        return
    # the deepspeed launcher appends --local_rank=N; the rank comes from the environment anyway
    argv = [a for a in argv if not a.startswith("--local_rank")]
    config_path = argv.pop(0) if argv and not argv[0].startswith("--") else None
    try:
        cfg = load_section(LearnerConfig, "learner", config_path, argv)
        if not cfg.buffer_host or not cfg.buffer_port:
            from buffer.config import BufferConfig

            # only the buffer's address is wanted: its other keys belong to the buffer role
            buf = load_section(BufferConfig, "buffer", config_path, {})
            cfg.buffer_host = cfg.buffer_host or buf.host
            cfg.buffer_port = cfg.buffer_port or buf.port
        weight_sync = None
        if cfg.weight_sync_port:
            from weight_sync.config import WeightSyncConfig

            # the sender's knobs (bucket size, backend, join timeout) live in the `weight_sync:` section
            weight_sync = load_section(WeightSyncConfig, "weight_sync", config_path, {})
    except ConfigError as e:
        print(f"launch.learner: {e}", file=sys.stderr)
        sys.exit(2)

    from learner.trainer import run

    run(cfg, weight_sync=weight_sync)


if __name__ == "__main__":
    main()
