"""Run configuration: one YAML file, a section per role, dotted command-line overrides.

Each package declares its own dataclass (`buffer.config.BufferConfig`, ...); this module only fills
them. Values are checked against the field types, unknown keys are errors that suggest the closest
known key, and each config's own `validate()` runs the cross-field checks.

Light on purpose: no torch, vllm or deepspeed here, so every `--help` answers at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Sequence


class ConfigError(ValueError):
    """A config file or flag that cannot be used; the message quotes the bad key and value."""


def _closest(key: str, known: Sequence[str]) -> str:
    near = difflib.get_close_matches(key, list(known), n=1, cutoff=0.5)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Coerce `value` (from YAML or a command-line string) to the annotated type `tp`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "~")):
            if type(None) in args:
                return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: cannot use {value!r}")
    if tp is Any:
        return value
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        return [_convert(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if isinstance(value, str):
            import yaml

            value = yaml.safe_load(value)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if typing.get_origin(tp) is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
        if f != int(f):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(f)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return build(tp, value, where)
    return value


def build(cls: type, values: dict | None, where: str) -> Any:
    """An instance of dataclass `cls` from a (possibly nested) mapping; unknown keys are errors."""
    values = values or {}
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: expected a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"{where}: unknown key {key!r}{_closest(key, fields)}")
        kwargs[key] = _convert(value, hints[key], f"{where}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def parse_overrides(argv: Sequence[str]) -> dict[str, str]:
    """`--a.b 1 --c=2 --flag` -> {"a.b": "1", "c": "2", "flag": "true"}."""
    out: dict[str, str] = {}
    i = 0
    argv = list(argv)
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key VALUE")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 1
        else:
            value = "true"
        out[key.replace("-", "_")] = value
        i += 1
    return out


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"--{dotted}: {p!r} is not a section")
        node = nxt
    node[parts[-1]] = value


def read_yaml(path: str | Path | None) -> dict:
    if not path:
        return {}
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections")
    return data


def load_section(cls: type, section: str, config_path: str | Path | None, overrides: Sequence[str] | dict) -> Any:
    """One role's config: section `section` of the YAML file, then `--section.key VALUE` overrides.

    Overrides may name the key with or without the section (`--buffer.port 1` or `--port 1`).
    Other sections of the file are ignored (they belong to other roles).
    """
    tree = read_yaml(config_path).get(section) or {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{config_path}: section {section!r} must be a mapping")
    tree = dict(tree)
    ov = overrides if isinstance(overrides, dict) else parse_overrides(overrides)
    for key, value in ov.items():
        sub = key[len(section) + 1:] if key.startswith(section + ".") else key
        set_dotted(tree, sub, value)
    cfg = build(cls, tree, section)
    if hasattr(cfg, "validate"):
        try:
            cfg.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return cfg


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of dataclass `cls` (its doc comment), read from the source."""
    import ast
    import inspect
    import textwrap

    docs = {}
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def config_help(cls: type, section: str) -> str:
    """Every key of dataclass `cls` with its type, default and doc comment (a role's `--help` epilog)."""
    import textwrap

    docs, hints, defaults = field_docs(cls), typing.get_type_hints(cls), cls()
    lines = [f"config keys (YAML section `{section}:`, or --{section}.KEY VALUE):"]
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        tp = tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")
        # the instance's value, not f.default: fields with a default_factory have no f.default
        lines.append(f"  --{section}.{f.name} {tp}  (default: {getattr(defaults, f.name)!r})")
        lines += textwrap.wrap(docs.get(f.name, ""), 96, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def dump(cfg: Any) -> dict:
    """A dataclass as plain data (for logging and saving the resolved config)."""
    return dataclasses.asdict(cfg)
