"""Typed dataclass configs: a YAML file plus dotted command-line overrides.

Every `posttrain <command> [CONFIG] [overrides]` goes through `load_config`. Values are layered in
this order, later layers winning:

    dataclass defaults  <  base (a dict from the caller)  <  the YAML file  <  each override, in order

Each value is checked against its field's type as its layer is applied, so an error can name where
the value came from (`sft.yaml:12` or `override 'optim.lr=abc'`) and its dotted key. When the whole
tree is built, every dataclass that defines `validate()` is asked to check itself (children first),
so cross-field checks see the final, overridden values.

Coercion rules worth knowing:
- Override values are parsed as YAML scalars/flow collections (`lr=1e-5`, `stop=[a,b]`,
  `weights={a: 1.0}`, `lora=null`). A `str` or `Path` field takes the override text verbatim, so
  `name=007` stays "007" and `tag=yes` stays "yes".
- PyYAML reads `1e-5` as a string (YAML 1.1 floats need a dot); float fields accept any string that
  Python's `float()` parses, int fields accept integral ones (`max_steps=1e4`). An int is fine for a
  float field; a bool is never a number.
- A section typed `X | None` is created with `X`'s defaults as soon as a key inside it is set
  (`lora.r=16`); setting the section itself to null disables it. Write `lora: {}` for all defaults.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import functools
import math
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePath
from typing import Any, Literal, NoReturn, TypeVar, Union

import yaml

from posttrain.errors import ConfigError

T = TypeVar("T")

_NONE_TYPE = type(None)
_UNSET = object()
_BARE_COLLECTIONS = (list, tuple, set, frozenset, dict)


# ----------------------------------------------------------------------------- public API


def load_config(
    cls: type[T],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    base: dict[str, Any] | None = None,
) -> T:
    """Build `cls` from defaults, `base`, the YAML file at `path`, then `key=value` overrides."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"load_config needs a dataclass type, got {cls!r}")
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'key=value' strings, not one string")
    builder = _Builder(cls)
    if base:
        builder.apply_mapping(builder.root, base, "", _Source("base config"))
    if path is not None:
        mapping, lines = _read_yaml(Path(path))
        builder.apply_mapping(builder.root, mapping, "", _Source(str(path), lines))
    for text in overrides:
        parts, value, raw_text = _parse_override(text)
        builder.assign(builder.root, parts, value, "", _Source(f"override '{text}'"), raw_text)
    label = str(path) if path is not None else "config"
    config = builder.build(builder.root, "", label)
    run_validators(config, lambda key, section: f"{label}: {key or type(section).__name__}")
    return config


def parse_cli_config(cls: type[T], argv: Sequence[str]) -> T:
    """`[CONFIG.yaml] [key=value | --key value | --key=value | --flag] ...` -> a loaded `cls`.

    A bare `--flag` (last, or followed by another `--option`) means `flag=true`.
    """
    args = list(argv)
    path = None
    if args and not args[0].startswith("-") and "=" not in args[0]:
        if not _looks_like_yaml_path(args[0]):
            raise ConfigError(f"'{args[0]}': expected a YAML config file (.yaml/.yml) or a key=value override")
        path = args.pop(0)
    return load_config(cls, path, _cli_overrides(args))


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain YAML-safe data (dicts, lists, str, numbers, None) that `load_config` reads back."""
    if not (dataclasses.is_dataclass(cfg) and not isinstance(cfg, type)):
        raise TypeError(f"config_to_dict needs a dataclass instance, got {type(cfg).__name__}")
    return _to_plain(cfg)


def save_config(cfg: Any, path: str | Path) -> None:
    """Write `cfg` as YAML, atomically, so a crash never leaves a half-written config behind."""
    path = Path(path)
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- sources of values


class _Source:
    """Where one layer of values came from; prefixes errors with `file.yaml:LINE` or the override."""

    def __init__(self, label: str, lines: dict[str, int] | None = None):
        self.label = label
        self.lines = lines or {}

    def where(self, key: str) -> str:
        # A value deep inside a YAML collection may have no line of its own: use its parent's.
        while key:
            if key in self.lines:
                return f"{self.label}:{self.lines[key]}"
            key = _parent_key(key)
        return self.label

    def fail(self, key: str, problem: str) -> NoReturn:
        raise ConfigError(f"{self.where(key)}: {key}: {problem}" if key else f"{self.label}: {problem}")


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The file's top-level mapping, and the 1-based line of every dotted key in it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read config file: {e}") from None
    # Compose the node tree first: it keeps the marks (line numbers) that plain safe_load drops.
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:  # an empty file, or only comments
            return {}, {}
        if not isinstance(node, yaml.MappingNode):
            kind = "a list" if isinstance(node, yaml.SequenceNode) else f"the value {node.value!r}"
            raise ConfigError(
                f"{path}:{node.start_mark.line + 1}: top level must be a mapping of config keys, got {kind}"
            )
        lines: dict[str, int] = {}
        _collect_key_lines(node, "", lines, path)
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{at}: YAML syntax error: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: YAML syntax error: {e}") from None
    finally:
        loader.dispose()
    return data, lines


def _collect_key_lines(node: yaml.Node, prefix: str, lines: dict[str, int], path: Path) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            # `<<: *anchor` merge keys name no config key; the merged values fall back to the parent's line.
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = _join(prefix, key_node.value)
            line = key_node.start_mark.line + 1
            # PyYAML silently keeps the last of two equal keys; that is always a mistake in a config.
            if key_node.value in seen:
                raise ConfigError(f"{path}:{line}: duplicate key '{key}' (first on line {lines[key]})")
            seen.add(key_node.value)
            lines[key] = line
            _collect_key_lines(value_node, key, lines, path)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[f"{prefix}[{i}]"] = item.start_mark.line + 1
            _collect_key_lines(item, f"{prefix}[{i}]", lines, path)


def _parse_override(text: str) -> tuple[list[str], Any, str]:
    """`optim.lr=1e-5` -> (["optim", "lr"], "1e-5" parsed as YAML, the raw text "1e-5")."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or any(not p or p != p.strip() for p in parts):
        raise ConfigError(f"override '{text}': expected key=value, like optim.lr=1e-5")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw  # not YAML (e.g. `prompt=a: b`): a str field still takes it, others say why not
    return parts, value, raw


def _cli_overrides(args: list[str]) -> list[str]:
    overrides = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            body = arg[2:]
            if not body or body.startswith("="):
                raise ConfigError(f"'{arg}': expected --key value or --key=value")
            if "=" in body:
                overrides.append(body)
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                overrides.append(f"{body}={args[i + 1]}")
                i += 1
            else:
                overrides.append(f"{body}=true")
        elif "=" not in arg and _looks_like_yaml_path(arg):
            raise ConfigError(f"'{arg}': the config file must come first, before any override")
        else:
            overrides.append(arg)
        i += 1
    return overrides


def _looks_like_yaml_path(arg: str) -> bool:
    return arg.endswith((".yaml", ".yml"))


# ----------------------------------------------------------------------------- building the tree


class _Section:
    """A dataclass being assembled: field name -> coerced value, a nested _Section, or None."""

    def __init__(self, cls: type, seed: Any = None):
        self.cls = cls
        self.values: dict[str, Any] = {}
        if seed is not None:  # start from a default instance so its non-class defaults survive
            self.values = {name: getattr(seed, name) for name in _fields(cls)}


class _Builder:
    def __init__(self, root_cls: type):
        self.root_cls = root_cls
        self.root = _Section(root_cls)

    def apply_mapping(self, section: _Section, mapping: Mapping, prefix: str, source: _Source) -> None:
        for key, value in mapping.items():
            name = self._field_name(section.cls, key, prefix, source)
            self._set_field(section, name, value, _join(prefix, name), source, raw_text=None)

    def assign(
        self, section: _Section, parts: list[str], value: Any, prefix: str, source: _Source, raw_text: str
    ) -> None:
        """Set one dotted key, creating sections on the way."""
        name = self._field_name(section.cls, parts[0], prefix, source)
        key = _join(prefix, name)
        if len(parts) == 1:
            self._set_field(section, name, value, key, source, raw_text)
            return
        field, field_type = _fields(section.cls)[name]
        inner, _ = _strip_optional(field_type)
        if _is_section(inner):
            self.assign(self._child(section, name), parts[1:], value, key, source, raw_text)
        elif typing.get_origin(inner) is dict and len(parts) == 2:
            # `weights.math=2.0` updates one entry; `weights={...}` replaces the whole dict.
            key_type, value_type = typing.get_args(inner) or (Any, Any)
            current = section.values.get(name, _UNSET)
            if current is _UNSET:
                current = _field_default(field)
            entries = dict(current) if isinstance(current, Mapping) else {}
            entry_key = _join(key, parts[1])
            entries[self.coerce(parts[1], key_type, entry_key, source)] = self.coerce(
                value, value_type, entry_key, source, raw_text
            )
            section.values[name] = entries
        else:
            source.fail(_join(key, ".".join(parts[1:])), f"'{key}' is a {_type_name(field_type)}, not a section")

    def _set_field(
        self, section: _Section, name: str, value: Any, key: str, source: _Source, raw_text: str | None
    ) -> None:
        _, field_type = _fields(section.cls)[name]
        inner, optional = _strip_optional(field_type)
        if not _is_section(inner):
            section.values[name] = self.coerce(value, field_type, key, source, raw_text)
        elif isinstance(value, inner):
            section.values[name] = copy.deepcopy(value)
        elif value is None:
            if not optional:
                problem = f"is a required {inner.__name__} section and cannot be null; use {{}} for defaults"
                source.fail(key, problem)
            section.values[name] = None
        elif isinstance(value, Mapping):
            self.apply_mapping(self._child(section, name), value, key, source)
        else:
            source.fail(key, f"expected a mapping of {inner.__name__} keys, got {_show(value)}")

    def _child(self, section: _Section, name: str) -> _Section:
        """The nested section `name`, created from its default (or its class defaults) if need be."""
        current = section.values.get(name, _UNSET)
        if isinstance(current, _Section):
            return current
        field, field_type = _fields(section.cls)[name]
        cls = _strip_optional(field_type)[0]
        if current is _UNSET or current is None:
            current = _field_default(field)
        seed = copy.deepcopy(current) if isinstance(current, cls) else None
        child = _Section(cls, seed)
        section.values[name] = child
        return child

    def _field_name(self, cls: type, key: Any, prefix: str, source: _Source) -> str:
        if not isinstance(key, str):
            source.fail(prefix, f"keys must be strings, got {key!r}")
        fields = _fields(cls)
        for name in (key, key.replace("-", "_")):  # `--max-steps` spelled like the CLI habit
            if name in fields:
                return name
        dotted = _join(prefix, key)
        raise ConfigError(f"{source.where(dotted)}: unknown key '{dotted}'{self._suggest(cls, key, prefix)}")

    def _suggest(self, cls: type, key: str, prefix: str) -> str:
        # The exact name in another section (`lr=` for `optim.lr=`) beats a fuzzy match next door.
        matches = [k for k in _dotted_keys(self.root_cls) if k.rsplit(".", 1)[-1] == key]
        if not matches:
            close = difflib.get_close_matches(key, list(_fields(cls)), n=3, cutoff=0.6)
            matches = [_join(prefix, c) for c in close]
        if matches:
            return " (did you mean " + " or ".join(f"'{m}'" for m in matches) + "?)"
        return f" ({cls.__name__} has: {', '.join(_fields(cls))})"

    def coerce(self, value: Any, tp: Any, key: str, source: _Source, raw_text: str | None = None) -> Any:
        """`value` checked against (and converted to) the annotation `tp`."""
        if tp is Any or tp is object:
            return value
        origin = typing.get_origin(tp) or (tp if tp in _BARE_COLLECTIONS else None)
        if _is_union(tp):
            return self._coerce_union(value, tp, key, source, raw_text)
        if origin is Literal:
            return _coerce_literal(value, tp, key, source, raw_text)
        if _is_section(tp):
            if isinstance(value, tp):
                return copy.deepcopy(value)
            if not isinstance(value, Mapping):
                source.fail(key, f"expected a mapping of {tp.__name__} keys, got {_show(value)}")
            section = _Section(tp)
            self.apply_mapping(section, value, key, source)
            return self.build(section, key, source.where(key))
        if origin in (list, tuple, set, frozenset):
            return self._coerce_sequence(value, tp, origin, key, source)
        if origin is dict:
            if not isinstance(value, Mapping):
                source.fail(key, f"expected a {_type_name(tp)} (write {{key: value}}), got {_show(value)}")
            key_type, value_type = typing.get_args(tp) or (Any, Any)
            return {
                self.coerce(k, key_type, key, source): self.coerce(v, value_type, _join(key, str(k)), source)
                for k, v in value.items()
            }
        return _coerce_scalar(value, tp, key, source, raw_text)

    def _coerce_union(self, value: Any, tp: Any, key: str, source: _Source, raw_text: str | None) -> Any:
        args = typing.get_args(tp)
        if value is None and _NONE_TYPE in args:
            return None
        options = [a for a in args if a is not _NONE_TYPE]
        if len(options) == 1:  # Optional[X]: X's own error is the precise one
            return self.coerce(value, options[0], key, source, raw_text)
        # Parsed value first, so `int | str` takes 5 as an int; the raw override text only as a fallback.
        for text in (None, raw_text) if raw_text is not None else (None,):
            for option in options:
                try:
                    return self.coerce(value, option, key, source, text)
                except ConfigError:
                    continue
        source.fail(key, f"expected {_type_name(tp)}, got {_show(value)}")

    def _coerce_sequence(self, value: Any, tp: Any, origin: type, key: str, source: _Source) -> Any:
        if not isinstance(value, (list, tuple)):
            source.fail(key, f"expected a {_type_name(tp)} (write [a, b]), got {_show(value)}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                source.fail(key, f"expected {len(args)} items for {_type_name(tp)}, got {len(value)}")
            item_types = list(args)
        else:
            item_types = [args[0] if args else Any] * len(value)
        items = (self.coerce(v, t, f"{key}[{i}]", source) for i, (v, t) in enumerate(zip(value, item_types)))
        return origin(items)

    def build(self, section: _Section, key: str, where: str) -> Any:
        kwargs = {}
        for name, (field, field_type) in _fields(section.cls).items():
            field_key = _join(key, name)
            value = section.values.get(name, _UNSET)
            if isinstance(value, _Section):
                value = self.build(value, field_key, where)
            elif value is _UNSET:
                if _field_default(field) is not _UNSET:
                    continue
                inner, optional = _strip_optional(field_type)
                if not (_is_section(inner) and not optional):
                    raise ConfigError(f"{where}: missing required key '{field_key}'")
                value = self.build(_Section(inner), field_key, where)  # a required section: its defaults
            kwargs[name] = value
        try:
            return section.cls(**kwargs)
        except ValueError as e:  # a __post_init__ check
            raise ConfigError(f"{where}: {key or section.cls.__name__}: {e}") from None


def run_validators(obj: Any, name_of: Callable[[str, Any], str], key: str = "") -> None:
    """Call `validate()` on every dataclass in the tree (through lists, tuples and dicts too), children before
    their parent. A ValueError becomes the ConfigError `<name_of(dotted key, dataclass)>: <error>`."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            run_validators(getattr(obj, field.name), name_of, _join(key, field.name))
        validate = getattr(obj, "validate", None)
        if callable(validate):
            try:
                validate()
            except ValueError as e:
                raise ConfigError(f"{name_of(key, obj)}: {e}") from None
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            run_validators(item, name_of, f"{key}[{i}]")
    elif isinstance(obj, dict):
        for k, item in obj.items():
            run_validators(item, name_of, _join(key, str(k)))


# ----------------------------------------------------------------------------- leaf coercion


def _coerce_literal(value: Any, tp: Any, key: str, source: _Source, raw_text: str | None) -> Any:
    choices = typing.get_args(tp)
    for choice in choices:
        if value == choice and type(value) is type(choice):  # True == 1, but not as a choice
            return choice
    if raw_text is not None and raw_text in choices:  # `mode=yes` for Literal["yes", "no"]: YAML made it True
        return raw_text
    shown = ", ".join(repr(c) for c in choices)
    close = difflib.get_close_matches(str(value), [c for c in choices if isinstance(c, str)], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    source.fail(key, f"must be one of {shown}; got {_show(value)}{hint}")


def _coerce_scalar(value: Any, tp: Any, key: str, source: _Source, raw_text: str | None) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        number = _float_from_text(value)
        if number is not None and math.isfinite(number) and number.is_integer():
            return int(number)  # `1e4` (a string to PyYAML) for a step count
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        number = _float_from_text(value)
        if number is not None:
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
        if raw_text is not None:
            return raw_text
        source.fail(key, f"expected str, got {_show(value)}; quote it to keep it as text")
    elif isinstance(tp, type) and issubclass(tp, PurePath):
        if isinstance(value, (str, PurePath)):
            return tp(value)
        if raw_text is not None:
            return tp(raw_text)
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):
        for member in tp:
            if value == member.value or value == member.name or value is member:
                return member
        names = ", ".join(repr(m.value) for m in tp)
        source.fail(key, f"must be one of {names}; got {_show(value)}")
    elif isinstance(tp, type):
        if isinstance(value, tp):
            return value
    else:
        raise TypeError(f"config field '{key}' has an unsupported annotation {tp!r}")
    source.fail(key, f"expected {_type_name(tp)}, got {_show(value)}")


def _float_from_text(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return float(value)
    except ValueError:
        return None


# ----------------------------------------------------------------------------- type helpers


@functools.cache
def _fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """Settable fields of a config dataclass with their resolved annotations (string ones too)."""
    try:
        hints = typing.get_type_hints(cls)
    except NameError as e:  # a string annotation naming a class local to a function
        raise TypeError(f"cannot resolve the annotations of config class {cls.__name__}: {e}") from None
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls) if f.init}


def _dotted_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for name, (_, field_type) in _fields(cls).items():
        key = _join(prefix, name)
        keys.append(key)
        inner, _ = _strip_optional(field_type)
        if _is_section(inner) and inner is not cls:
            keys.extend(_dotted_keys(inner, key))
    return keys


def _field_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return _UNSET


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    """(X, True) for `X | None`; (tp, False) for anything else."""
    if _is_union(tp):
        args = typing.get_args(tp)
        options = tuple(a for a in args if a is not _NONE_TYPE)
        if len(options) < len(args):
            return (options[0] if len(options) == 1 else Union[options]), True  # noqa: UP007 (a Union built from a tuple)
    return tp, False


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return repr(tp).replace("typing.", "").replace("pathlib.", "").replace("NoneType", "None")


def _show(value: Any) -> str:
    return "null" if value is None else f"{value!r} ({type(value).__name__})"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _parent_key(key: str) -> str:
    cut = max(key.rfind("."), key.rfind("["))
    return key[:cut] if cut > 0 else ""


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, enum.Enum):
        return _to_plain(value.value)
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, Mapping):
        return {_to_plain(k): _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_to_plain(v) for v in value]
    return value
