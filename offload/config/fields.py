"""Typed config fields and the one generic parser that reads every section.

A section is a ``@dataclass(kw_only=True, slots=True)`` whose fields are made by
:func:`setting` / :func:`section`; their metadata (doc, range, choices, aliases,
whether "auto" is allowed, how far we support the key) drives parsing, error
messages and the generated docs, so defaults and rules live in one place.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import logging
import math
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

logger = logging.getLogger("offload.config")


class ConfigError(ValueError):
    """A config value is wrong. ``path`` is the dotted key path ('' for the whole config)."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.reason = message
        super().__init__(f"{path}: {message}" if path else message)

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str]]:  # crosses from a rank's process whole
        return ConfigError, (self.path, self.reason)


class Auto:
    """The value "auto": filled in from the model and world at initialize (:meth:`Config.resolve`)."""

    _instance: Auto | None = None

    def __new__(cls) -> Auto:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "AUTO"

    def __str__(self) -> str:  # what a config file says, in messages and notes
        return "auto"

    def __reduce__(self) -> str:
        return "AUTO"


AUTO = Auto()

_T = TypeVar("_T")


def resolved(value: _T | Auto) -> _T:
    """A key's value where the runtime reads it: Config.resolve has filled its "auto" (every key's but
    RUNTIME_AUTO's), which the type checker cannot know."""
    assert not isinstance(value, Auto), "a config key read before Config.resolve filled its auto"
    return value


class Support(enum.Enum):
    """How far the runtime honours a key: each key has exactly one status, declared with the key."""

    HONOURED = "honoured"  # code outside offload/config reads it (a test finds the reader)
    NO_EFFECT = "no effect"  # accepted; setting it (to anything but its default) is reported with the note's reason
    REFUSED = "refused"  # setting it is an error naming what to do instead: ignoring it would change training


class NoEffect(str):
    """A note saying that a key the config set does nothing here (and why); ``path`` is the key."""

    path: str

    def __new__(cls, path: str, reason: str) -> NoEffect:
        note = super().__new__(cls, f"{path} has no effect in offload: {reason}")
        note.path = path
        return note


@dataclass(frozen=True, slots=True)
class Spec:
    doc: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] | None = None
    # values a reader might expect among the choices, each with why it is not one and what to use instead
    refused_choices: tuple[tuple[str, str], ...] = ()
    auto: bool = False
    aliases: tuple[str, ...] = ()
    support: Support = Support.HONOURED
    note: str = ""  # NO_EFFECT: why it does nothing; REFUSED: what to do instead
    size: bool = False  # accepts byte sizes such as "8GiB"
    hint_from: Callable[[Mapping[str, Any]], Any] | None = None  # type chosen by sibling values


def setting(default: Any, doc: str, **spec: Any) -> Any:
    """A scalar field: its default, its doc, and its rules (see :class:`Spec`); a list default is copied for each
    config."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"spec": Spec(doc=doc, **spec)})
    return field(default=default, metadata={"spec": Spec(doc=doc, **spec)})


def section(factory: Callable[[], Any] | None, doc: str, **spec: Any) -> Any:
    """A nested section; ``factory`` None means the section is absent unless given."""
    if factory is None:
        return field(default=None, metadata={"spec": Spec(doc=doc, **spec)})
    return field(default_factory=factory, metadata={"spec": Spec(doc=doc, **spec)})


def spec_of(f: dataclasses.Field[Any]) -> Spec:
    return f.metadata["spec"]


def public_fields(cls_or_obj: Any) -> list[dataclasses.Field[Any]]:
    """The fields that are config keys (not internal bookkeeping such as Config.notes)."""
    return [f for f in dataclasses.fields(cls_or_obj) if "spec" in f.metadata]


# --------------------------------------------------------------------------- values

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}  # the command line's spelling (12Gi) too
_SIZE_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _to_number(value: Any, path: str, size: bool) -> float:
    if isinstance(value, bool) or value is None:
        raise ConfigError(path, f"expected a number, got {_describe(value)}")
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and (m.group(2) == "" or size):
            unit = _SIZE_UNITS.get(m.group(2).lower())
            if unit is not None:
                number = float(m.group(1).replace("_", ""))
                return number * unit if unit != 1 else (int(m.group(1)) if m.group(1).isdigit() else number)
        hint = ' or a size such as "8GiB"' if size else ' (a string such as "5e8" is fine)'
        raise ConfigError(path, f"expected a number{hint}, got {_describe(value)}")
    raise ConfigError(path, f"expected a number, got {type(value).__name__} {_describe(value)}")


def to_int(value: Any, path: str, size: bool = False) -> int:
    number = _to_number(value, path, size)
    if isinstance(number, float):
        if not math.isfinite(number) or number != int(number):
            raise ConfigError(path, f"expected a whole number, got {_describe(value)}")
        number = int(number)
    return number


def to_float(value: Any, path: str) -> float:
    number = float(_to_number(value, path, False))
    if not math.isfinite(number):
        raise ConfigError(path, f"expected a finite number, got {number}")
    return number


def _check_range(value: float, spec: Spec, path: str) -> None:
    if spec.ge is not None and value < spec.ge:
        raise ConfigError(path, f"must be >= {spec.ge:g}, got {value:g}")
    if spec.gt is not None and value <= spec.gt:
        raise ConfigError(path, f"must be > {spec.gt:g}, got {value:g}")
    if spec.le is not None and value > spec.le:
        raise ConfigError(path, f"must be <= {spec.le:g}, got {value:g}")
    if spec.lt is not None and value >= spec.lt:
        raise ConfigError(path, f"must be < {spec.lt:g}, got {value:g}")


def _choice(value: Any, choices: tuple[str, ...], path: str) -> str:
    if isinstance(value, bool) and {"on", "off"} <= set(choices):  # JSON's true/false for a switch
        return "on" if value else "off"
    if isinstance(value, str):
        for c in choices:
            if value.lower() == c.lower():
                return c
        near = difflib.get_close_matches(value, choices, n=1, cutoff=0.5)
        hint = f"; did you mean {near[0]!r}?" if near else ""
    else:
        hint = ""
    listed = ", ".join(repr(c) for c in choices)
    raise ConfigError(path, f"{_describe(value)} is not one of {listed}{hint}")


def _strip_optional(hint: Any) -> tuple[Any, bool]:
    """(the core type, whether null is allowed), with Auto removed."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a not in (Auto, type(None))]
        nullable = type(None) in typing.get_args(hint)
        core = args[0] if len(args) == 1 else typing.Union[tuple(args)]
        return core, nullable
    return hint, False


def coerce(value: Any, hint: Any, spec: Spec, path: str, notes: list[str]) -> Any:
    """Check and convert one raw JSON value to the field's type."""
    if spec.auto and isinstance(value, str) and value.strip().lower() == "auto":
        return AUTO
    core, nullable = _strip_optional(hint)
    if value is None:
        if nullable:
            return None
        raise ConfigError(path, "must not be null; leave the key out to get its default")
    if dataclasses.is_dataclass(core):  # a section class (a hint is never a dataclass instance)
        return parse_section(typing.cast(type, core), value, path, notes)
    origin = typing.get_origin(core)
    if core is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {_describe(value)}")
        return value
    if core is int:
        result: Any = to_int(value, path, spec.size)
    elif core is float:
        result = to_float(value, path)
    elif core is str:
        if spec.choices:
            for refused, why in spec.refused_choices:
                if isinstance(value, str) and value.lower() == refused.lower():
                    raise ConfigError(path, f"{value!r}: {why}")
            return _choice(value, spec.choices, path)
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {_describe(value)}")
        return value
    elif origin is tuple:
        args = typing.get_args(core)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(path, f"expected a list of {len(args)} numbers, got {_describe(value)}")
        result = tuple(coerce(v, a, Spec(doc=""), f"{path}[{i}]", notes)
                       for i, (v, a) in enumerate(zip(value, args, strict=True)))
        for i, v in enumerate(result):
            _check_range(v, spec, f"{path}[{i}]")
        return result
    elif origin is list:
        (arg,) = typing.get_args(core)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {_describe(value)}")
        return [coerce(v, arg, Spec(doc=""), f"{path}[{i}]", notes) for i, v in enumerate(value)]
    elif origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected an object, got {_describe(value)}")
        return dict(value)
    else:  # pragma: no cover - a schema bug, not user input
        raise TypeError(f"{path}: unsupported field type {core!r}")
    _check_range(result, spec, path)
    return result


# --------------------------------------------------------------------------- sections

def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _field_names(cls: type) -> dict[str, dataclasses.Field[Any]]:
    """Every accepted key (names and aliases) -> its field."""
    names: dict[str, dataclasses.Field[Any]] = {}
    for f in public_fields(cls):
        names[f.name] = f
        for alias in spec_of(f).aliases:
            names[alias] = f
    return names


# Leaf name -> the dotted paths where that key belongs; filled by load.py, so that a key
# written in the wrong section is told where it goes.
KEY_HOMES: dict[str, list[str]] = {}


def unknown_key(cls: type, key: Any, path: str) -> ConfigError:
    if not isinstance(key, str):
        return ConfigError(path, f"keys must be strings, got {_describe(key)}")
    here = f"{path}.{key}" if path else key
    homes = [h for h in KEY_HOMES.get(key, []) if h != here]
    if homes:
        where = " or ".join(h.rsplit(".", 1)[0] for h in homes)
        return ConfigError(here, f"unknown key here; it belongs under {where}")
    known = sorted(f.name for f in public_fields(cls))
    candidates = {name: f.name for name, f in _field_names(cls).items()}
    near = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    if near:
        canonical = candidates[near[0]]
        also = f" (older name {near[0]!r})" if near[0] != canonical else ""
        return ConfigError(here, f"unknown key; did you mean {canonical!r}{also}?")
    return ConfigError(here, f"unknown key; {path or 'the top level'} takes: {', '.join(known)}")


def parse_section(cls: type, raw: Any, path: str, notes: list[str]) -> Any:
    """Build section ``cls`` from its raw JSON object, or raise ConfigError naming the key."""
    if not isinstance(raw, Mapping):
        raise ConfigError(path, f"expected an object of {cls.__name__} keys, got {_describe(raw)}")
    names = _field_names(cls)
    by_field: dict[str, tuple[str, Any]] = {}
    for key, value in raw.items():
        f = names.get(key) if isinstance(key, str) else None
        if f is None:
            raise unknown_key(cls, key, path)
        here = f"{path}.{key}" if path else key
        if f.name in by_field:
            raise ConfigError(here, f"given twice, as {by_field[f.name][0]!r} and {key!r}; keep one")
        if key != f.name:
            notes.append(f"{here} is an older name of {f.name!r}; read as {f.name}")
        by_field[f.name] = (key, value)
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for f in public_fields(cls):
        if f.name not in by_field:
            continue
        spec = spec_of(f)
        hint = spec.hint_from(values) if spec.hint_from else hints[f.name]
        written = by_field[f.name][0]  # errors name the key as the user wrote it (maybe an alias)
        here = f"{path}.{written}" if path else written
        values[f.name] = coerce(by_field[f.name][1], hint, spec, here, notes)
    obj = cls(**values)
    _check_support(obj, path, notes)
    check = getattr(obj, "check", None)
    if check is not None:
        check(path)
    return obj


def _is_active(value: Any, f: dataclasses.Field[Any]) -> bool:
    """Whether a value set for a NO_EFFECT/REFUSED key would change anything."""
    if dataclasses.is_dataclass(value) and hasattr(value, "enabled"):
        return bool(value.enabled)
    if isinstance(value, Mapping):
        return bool(value) and value.get("enabled", True) is not False
    return value != _default_of(f)


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _check_support(obj: Any, path: str, notes: list[str]) -> None:
    """REFUSED keys set: an error; NO_EFFECT keys set, and keys a section says its siblings make inert: a note."""
    inert = obj.inert() if hasattr(obj, "inert") else {}
    for f in public_fields(obj):
        spec = spec_of(f)
        if spec.support is Support.HONOURED and f.name not in inert:
            continue
        value = getattr(obj, f.name)
        if not _is_active(value, f):
            continue
        here = f"{path}.{f.name}" if path else f.name
        if spec.support is Support.REFUSED:
            extra = f" {spec.note}" if spec.note else ""
            raise ConfigError(here, f"is not supported by offload (got {_describe(value)}).{extra}")
        notes.append(NoEffect(here, spec.note if spec.support is Support.NO_EFFECT else inert[f.name]))


def to_raw(obj: Any) -> Any:
    """A section back to DeepSpeed-format JSON values (AUTO -> "auto")."""
    if obj is AUTO:
        return "auto"
    if dataclasses.is_dataclass(obj):
        return {f.name: to_raw(getattr(obj, f.name)) for f in public_fields(obj)}
    if isinstance(obj, tuple):
        return [to_raw(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_raw(v) for k, v in obj.items()}
    return obj


@dataclass(frozen=True, slots=True)
class FieldInfo:
    path: str
    hint: Any
    spec: Spec
    default: Any
    variant: str = ""  # for keys whose section depends on a sibling (scheduler params): which class


def iter_fields(cls: type, prefix: str = "", variants: Mapping[str, tuple[type, ...]] | None = None,
                inherited: Spec | None = None) -> Iterator[FieldInfo]:
    """Every key of a section, depth first (for docs and tests). The keys inside a section that has no effect
    or is refused carry that section's status and note."""
    hints = _hints(cls)
    for f in public_fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        spec = spec_of(f)
        if inherited is not None:
            spec = dataclasses.replace(spec, support=inherited.support, note=inherited.note)
        below = spec if spec.support is not Support.HONOURED else None
        core, _ = _strip_optional(hints[f.name])
        if spec.hint_from is not None and variants and path in variants:
            yield FieldInfo(path, variants[path][0], spec, None)
            for variant in variants[path]:
                for info in iter_fields(variant, path, variants, below):
                    yield dataclasses.replace(info, variant=variant.__name__)
        elif dataclasses.is_dataclass(core):  # a section class (a hint is never a dataclass instance)
            yield FieldInfo(path, core, spec, None)
            yield from iter_fields(typing.cast(type, core), path, variants, below)
        else:
            yield FieldInfo(path, hints[f.name], spec, _default_of(f))
