"""One way to declare a config section, and one command line for every entry point.

A section is a pydantic v2 model (`Section`): each field has a type, a default, constraints
declared on it (`Field(ge=0)`), and a docstring under it that `--help` prints. pydantic rather
than msgspec Structs because a config is read by people, not at wire speed: pydantic gives field
docs (`use_attribute_docstrings`), constraints and validators declared beside the field, every
problem of a section reported at once, and the key path and input of each problem, which
`explain` turns into our one-line messages (`learner.lr=-1.0 must be > 0`). msgspec stays the
wire's codec.

    class BufferConfig(Section):
        section: ClassVar[str] = "buffer"
        port: int = Field(5555, gt=0, lt=65533)
        \"\"\"Control socket; the next three ports are ...\"\"\"

What a section checks, and when:
- field constraints and field validators: at construction, phrased after `key=value`;
- `problems()`: cross-field checks (a model validator), full sentences quoting the values;
- `missing()`: what must be filled in before a role runs (a model path, a dataset); not checked
  at construction, because launchers build a section first and fill such keys in afterwards.
  `validate()` runs all three on the current values.

The command line (`parse_overrides`, `apply_flags`, `render_help`): a YAML file with a section per
role, dotted `--section.key VALUE` overrides (or `--key VALUE` for the entry point's own
section), OpenRLHF flags as `Alias`es, one suggester for unknown keys and flags, and one `--help`
renderer. No torch here: every `--help` answers at once.
"""

from __future__ import annotations

import copy
import difflib
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal, Mapping, NamedTuple, Sequence

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import PydanticCustomError

TRUE = ("1", "true", "yes", "on", "y", "t")
FALSE = ("0", "false", "no", "off", "n", "f")


class ConfigError(ValueError):
    """A config value that cannot be used; the message quotes the key and the bad value.

    `parts` are (key path, text): text follows the key (`=1.5 must be <= 1`, `: unknown key ...`);
    a part with path None is a whole sentence (a cross-field check)."""

    def __init__(self, parts: Sequence[tuple[tuple | None, str]] | str, loose: Any = None):
        self.parts = [(None, parts)] if isinstance(parts, str) else list(parts)
        self.loose = loose  # the section built without checks, for completeness checks on failure
        super().__init__("; ".join(render(p, t) for p, t in self.parts))


def render(path: tuple | None, text: str) -> str:
    if path is None:
        return text
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out + text


def parse_bool(value: Any) -> bool:
    """The one reading of a boolean from YAML or a flag: 1/true/yes/on, 0/false/no/off (any case)."""
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise ValueError(f"expected true/false, got {value!r}")


def suggest(key: str, known: Sequence[str], flag: bool = False) -> str:
    """` (did you mean 'x'?)` for the closest known key (`--x` for a flag), or ``."""
    near = difflib.get_close_matches(key, list(known), n=1, cutoff=0.5)
    if not near:
        return ""
    return f" (did you mean --{near[0]}?)" if flag else f" (did you mean {near[0]!r}?)"


class Endpoint(NamedTuple):
    """A service's address: one host and its first port (a service may use the next few too)."""

    host: str
    port: int

    def url(self, offset: int = 0) -> str:
        return f"tcp://{self.host}:{self.port + offset}"


# ---- the section base ----------------------------------------------------------------------


def _read(value: Any, tp: Any) -> Any:
    """A string from a flag (or YAML) read as type `tp`; anything it cannot read is returned as is
    for pydantic to report with the key."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str)
                                                      and value.strip().lower() in ("none", "null", "~"))):
            return None
        rest = [a for a in args if a is not type(None)]
        return _read(value, rest[0]) if len(rest) == 1 else value
    if not isinstance(value, str):
        return value
    try:
        if tp is bool:
            return parse_bool(value)
        if tp is int:
            f = float(value)
            return int(f) if f == int(f) else value
        if tp is float:
            return float(value)
        if origin in (list, tuple):
            inner = args[0] if args else Any
            return [_read(v.strip(), inner) for v in value.split(",") if v.strip() != ""]
        if origin is dict or tp is dict:
            import yaml

            return yaml.safe_load(value)
    except (TypeError, ValueError, OverflowError):
        return value
    return value


_PREDICATES = {
    "greater_than": "must be > {gt}", "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}", "less_than_equal": "must be <= {le}",
    "finite_number": "must be finite", "literal_error": "is not one of {expected}",
}
_EXPECTED = {
    "int_parsing": "an integer", "int_from_float": "an integer", "int_type": "an integer",
    "float_parsing": "a number", "float_type": "a number", "bool_parsing": "true/false", "bool_type": "true/false",
    "string_type": "a string", "list_type": "a list", "dict_type": "a mapping", "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}


def explain(e: ValidationError) -> list[tuple[tuple | None, str]]:
    """pydantic's errors as (key path, text after the key) parts in our wording."""
    parts: list[tuple[tuple | None, str]] = []
    for err in e.errors(include_url=False):
        loc, kind, ctx = tuple(err["loc"]), err["type"], err.get("ctx") or {}
        inner = ctx.get("error")
        if isinstance(inner, ConfigError):  # a nested section: its parts, under this key
            parts += [(p if p is None else loc + p, t) for p, t in inner.parts]
        elif kind == "problems":
            parts.append((None, ctx["msg"]))
        elif kind == "unknown_key":
            parts.append((loc, ": " + err["msg"]))
        elif kind in _PREDICATES:
            ctx = {k: f"{v:g}" if isinstance(v, float) else v for k, v in ctx.items()}
            parts.append((loc, f"={err['input']!r} " + _PREDICATES[kind].format(**ctx)))
        elif kind in _EXPECTED:
            parts.append((loc, f": expected {_EXPECTED[kind]}, got {err['input']!r}"))
        elif kind in ("value_error", "assertion_error"):
            parts.append((loc, f"={err['input']!r} {inner}"))
        else:
            parts.append((loc, f"={err['input']!r}: {err['msg']}"))
    return parts


class Section(BaseModel):
    """Base of every config section: typed, documented, unknown keys refused with a suggestion.

    Assignment is not checked (launchers fill sections in step by step, like dataclass fields);
    `validate()` checks the values a section holds now."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    section: ClassVar[str] = ""
    """The section's key in the run config (`buffer`); error messages start with it."""

    def __init__(self, /, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as e:
            parts, loose = explain(e), self._loose(data, e)
            if loose is not None and not any(p is None for p, _ in parts):
                parts += [(None, m) for m in _safe(loose.problems)]  # cross-field checks too, at once
            where = (type(self).section,) if type(self).section else ()  # nested: the outer key's
            raise ConfigError([(p if p is None else where + p, t) for p, t in parts], loose) from None

    @classmethod
    def _loose(cls, data: dict, e: ValidationError) -> Section | None:
        bad = {err["loc"][0] for err in e.errors() if err["loc"]}
        try:
            return cls.model_construct(**{k: v for k, v in cls._read_strings(dict(data)).items()
                                          if k in cls.model_fields and k not in bad})
        except Exception:
            return None

    @model_validator(mode="before")
    @classmethod
    def _read_strings(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        for key in data:
            if key not in fields:
                raise PydanticCustomError("unknown_key", "{msg}",
                                          {"msg": f"unknown key {key!r}{suggest(str(key), list(fields))}"})
        return {k: _read(v, fields[k].annotation) for k, v in data.items()}

    @model_validator(mode="after")
    def _cross_checks(self) -> Section:
        errs = self.problems()
        if errs:
            raise PydanticCustomError("problems", "{msg}", {"msg": "; ".join(errs)})
        return self

    def problems(self) -> list[str]:
        """Cross-field checks, each a sentence quoting the values; overridden per section."""
        return []

    def missing(self) -> list[str]:
        """What must be set before the role runs (checked by `validate`, not at construction)."""
        return []

    def validate(self) -> Section:  # type: ignore[override]
        """Check the values held now (after a launcher filled them in); raise ConfigError."""
        parts: list = []
        try:
            type(self)(**self.model_dump())
        except ConfigError as e:
            parts += e.parts
        parts += [(None, m) for m in self.missing()]
        if parts:
            raise ConfigError(parts)
        return self

    def replace(self, **changes: Any) -> Section:
        """A checked copy with some fields changed (what `dataclasses.replace` did)."""
        return type(self)(**{**dict(self), **changes})

    def to_dict(self) -> dict:
        """Plain data, nested sections as mappings (for YAML, logs, metrics)."""
        return self.model_dump()


def _safe(f: Callable[[], list[str]]) -> list[str]:
    try:
        return f()
    except Exception:  # a loose section may hold values of the wrong type
        return []


def redefault(base: type[Section], name: str, default: Any) -> Any:
    """Field `name` of `base` (constraints and doc included) with another default, for a subclass:
    `lr: float = redefault(OptimConfig, "lr", 1e-5)`."""
    f = copy.copy(base.model_fields[name])
    f.default = default
    f.default_factory = None
    return f


def build(cls: type[Section], values: Any, where: str = "", complete: bool = False) -> Any:
    """`cls` from a mapping (a YAML section with overrides); with `complete`, `missing()` too."""
    values = {} if values is None else values
    if not isinstance(values, dict):
        raise ConfigError(f"{where or cls.section}: expected a mapping, got {values!r}")
    try:
        cfg = cls(**values)
    except ConfigError as e:
        if complete and e.loose is not None:  # what is missing too, at once
            raise ConfigError(e.parts + [(None, m) for m in _safe(e.loose.missing)]) from None
        raise
    if complete:
        cfg.validate()
    return cfg


# ---- the command line ----------------------------------------------------------------------


@dataclass(frozen=True)
class Alias:
    """An OpenRLHF flag: the dotted keys it sets (a bare key: the entry point's own section;
    `extra.X`: handed back to the caller) and how its value reads. No targets: accepted and
    ignored, with `note` said on stderr."""

    targets: tuple[str, ...] = ()
    convert: Callable[[str], Any] = str
    note: str = ""


def ignored(why: str) -> Alias:
    return Alias((), str, why)


def renames(**flags: str | tuple[str, ...]) -> dict[str, Alias]:
    """Aliases that only rename: `renames(pretrain=("learner.model_path", "generator.model"))`."""
    return {f: Alias((t,) if isinstance(t, str) else tuple(t)) for f, t in flags.items()}


def parse_overrides(argv: Sequence[str]) -> dict[str, str]:
    """`--a.b 1 --c=2 --flag --d 3 4` -> {"a.b": "1", "c": "2", "flag": "true", "d": "3,4"} (dashes
    in keys read as _; several values are joined by commas, as a list field reads them)."""
    out: dict[str, str] = {}
    argv = list(argv)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key VALUE")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            values = []  # several values (argparse's nargs, `--target_modules q_proj v_proj`): a list
            while i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                values.append(argv[i + 1])
                i += 1
            value = ",".join(values)
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
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"--{dotted}: {p!r} is not a section")
        node = nxt
    node[parts[-1]] = value


def is_set(tree: dict, dotted: str) -> bool:
    node: Any = tree
    for p in dotted.split("."):
        if not isinstance(node, dict) or p not in node:
            return False
        node = node[p]
    return True


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


def split_argv(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """(CONFIG or None, the flags after it); the --local_rank=N the deepspeed launcher appends is
    dropped (the rank comes from the environment)."""
    argv = [a for a in argv if not a.startswith("--local_rank")]
    if argv and not argv[0].startswith("-"):
        return argv[0], argv[1:]
    return None, argv


def wants_help(argv: Sequence[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def apply_flags(tree: dict, argv: Sequence[str] | Mapping[str, Any], sections: Mapping[str, type[Section]],
                aliases: Mapping[str, Alias] | None = None, own: str | None = None) -> dict[str, Any]:
    """Write the flags into `tree` (a mapping of sections); returns the `extra.*` alias values.

    `--section.key V` for any of `sections`; `--key V` for a key of section `own`, else an alias.
    An unknown section or flag is an error naming it and suggesting the closest known one."""
    aliases = aliases or {}
    flags = argv if isinstance(argv, Mapping) else parse_overrides(argv)
    extra: dict[str, Any] = {}
    for key, value in flags.items():
        head, dot, _ = key.partition(".")
        if dot and key not in aliases:
            if head not in sections:
                raise ConfigError(f"--{key}: unknown section {head!r}{suggest(head, list(sections))}")
            set_dotted(tree, key, value)
        elif own and key in sections[own].model_fields:
            set_dotted(tree, f"{own}.{key}", value)
        elif key in aliases:
            alias = aliases[key]
            if not alias.targets:
                print(f"note: --{key} is accepted for OpenRLHF compatibility and ignored here: {alias.note}",
                      file=sys.stderr)
                continue
            try:
                value = alias.convert(value)
            except ConfigError:
                raise
            except (TypeError, ValueError) as e:
                why = str(e) if isinstance(e, ValueError) and str(e) and "invalid literal" not in str(e) else ""
                raise ConfigError(f"--{key}: cannot use {value!r}" + (f" ({why})" if why else "")) from None
            for t in alias.targets:
                if t.startswith("extra."):
                    extra[t[6:]] = value
                else:
                    set_dotted(tree, t if "." in t else f"{own}.{t}", value)
        else:
            known = list(aliases) + [f"{s}.{f}" for s, c in sections.items() for f in c.model_fields]
            if own:
                known += list(sections[own].model_fields)
            # an entry point with its own section (the offline trainers) takes bare flags: suggest one
            raise ConfigError(f"unknown flag --{key}{suggest(key, known, flag=own is not None)}")
    return extra


def load_section(cls: type[Section], section: str, config_path: str | Path | None,
                 overrides: Sequence[str] | Mapping[str, Any] = (), aliases: Mapping[str, Alias] | None = None,
                 complete: bool = True) -> Any:
    """One role's section: the YAML file's `section:`, then the flags (dotted, bare or aliases).
    Other sections of the file are ignored (they belong to other roles)."""
    sub = read_yaml(config_path).get(section) or {}
    if not isinstance(sub, dict):
        raise ConfigError(f"{config_path}: section {section!r} must be a mapping, got {sub!r}")
    tree = {section: dict(sub)}
    apply_flags(tree, overrides, {section: cls}, aliases, own=section)
    return build(cls, tree[section], section, complete=complete)


# ---- --help ----------------------------------------------------------------------------------


def type_name(field: Any) -> str:
    """`int >= 0`, `grpo | rloo`, `list[int]`, `float | null` for a field's annotation and constraints."""
    tp = field.annotation
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        name = " | ".join(str(a) for a in args)
    elif origin in (typing.Union, types.UnionType):
        name = " | ".join("null" if a is type(None) else getattr(a, "__name__", str(a)) for a in args)
    elif origin is not None:
        name = str(tp).replace("typing.", "")
    else:
        name = getattr(tp, "__name__", str(tp))
    bounds = [f"{sym} {getattr(m, attr)}" for m in field.metadata
              for attr, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
              if getattr(m, attr, None) is not None]
    return f"{name} {', '.join(bounds)}" if bounds else name


def section_help(cls: type[Section], section: str, bare: bool = False) -> list[str]:
    """Each key of `cls` with its default, type and doc, as `--section.key = default  (type)`."""
    return [f"Keys of the `{section}:` section (override as --{section}.KEY VALUE"
            + (" or --KEY VALUE):" if bare else "):"), *_field_lines(cls, section)]


def help_order(cls: type[Section]) -> list[str]:
    """Field names with the class's own first, then each base's (an address mixin's keys last)."""
    import inspect

    names: list[str] = []
    for klass in cls.__mro__:
        if isinstance(klass, type) and issubclass(klass, Section):
            names += [n for n in inspect.get_annotations(klass) if n in cls.model_fields and n not in names]
    return names + [n for n in cls.model_fields if n not in names]


def _field_lines(cls: type[Section], prefix: str) -> list[str]:
    lines = []
    for name in help_order(cls):
        f = cls.model_fields[name]
        default = f.get_default(call_default_factory=True)
        if isinstance(default, Section):
            lines += [f"  --{prefix}.{name}.*   {' '.join((f.description or '').split())}"]
            lines += _field_lines(type(default), f"{prefix}.{name}")
            continue
        lines.append(f"  --{prefix}.{name} = {default!r}   ({type_name(f)})")
        lines += textwrap.wrap(" ".join((f.description or "").split()), 96,
                               initial_indent=" " * 6, subsequent_indent=" " * 6)
    return lines


def render_help(doc: str, sections: Mapping[str, type[Section]], aliases: Mapping[str, Alias] | None = None,
                own: str | None = None) -> str:
    """An entry point's `--help`: its module docstring, every key of its sections, its OpenRLHF flags."""
    out = [textwrap.dedent(doc).strip(), ""]
    for name, cls in sections.items():
        out += section_help(cls, name, bare=name == own) + [""]
    describe = getattr(aliases, "describe", None)  # a table that groups its flags with their meaning
    if describe is not None:
        out += describe()
    elif aliases:
        out += textwrap.wrap("OpenRLHF flags (same meaning as there): " + ", ".join(f"--{a}" for a in aliases),
                             100, break_on_hyphens=False)
    return "\n".join(out).rstrip() + "\n"
