"""Reading configs: loading a config file, and ``--set key=value`` overrides.

A config file under ``experiments/configs/`` defines ``get_config()`` returning a
`Config` (or a subclass with extra fields), or a study or an analysis. ``--set key=value``
converts ``value`` with the field's type annotation; nested dataclass fields take dotted
keys; `flatten` writes a config's fields back in that spelling.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import sys
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shoal.experiments.config import Config, ConfigError


def load_file(spec: str | Path) -> Any:
    """Run ``get_config()`` from a config file and return what it returns (a `Config`, or
    a `shoal.experiments.runner.study.Study`).

    ``spec`` is a path to a ``.py`` file, or the bare name of a bundled config
    (``"quickstart"`` for ``experiments/configs/quickstart.py``).
    """
    path = Path(spec)
    if not path.is_file() and path.suffix == "" and path.parent == Path("."):
        path = Path(__file__).parent / "configs" / f"{spec}.py"
    if not path.is_file():
        raise ConfigError(f"config file not found: {spec}")
    # Registered in sys.modules so typing.get_type_hints can resolve a config subclass's
    # annotations.
    mod_name = f"_shoal_config_{path.stem}"
    spec_ = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec_)
    sys.modules[mod_name] = module
    spec_.loader.exec_module(module)
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
        raise ConfigError(f"{path} does not define get_config()")
    return get_config()


def load_config(spec: str | Path) -> Config:
    """Run ``get_config()`` from a config file (see `load_file`) that returns a `Config`."""
    cfg = load_file(spec)
    if not isinstance(cfg, Config):
        raise ConfigError(
            f"{spec}: get_config() must return a shoal.experiments.config.Config, "
            f"got {type(cfg).__name__}"
        )
    return cfg


def parse_assignment(item: str) -> tuple[str, str]:
    """``"key=value"`` -> ``("key", "value")`` (stripped); `ConfigError` if it is not one."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set expects key=value, got {item!r}")
    return key, text.strip()


def apply_overrides(cfg: Any, assignments: Iterable[str | tuple[str, str]]) -> Any:
    """Apply ``key=value`` strings (or `parse_assignment` pairs) in order; raises
    `ConfigError` naming the bad key or value."""
    for item in assignments:
        key, text = item if isinstance(item, tuple) else parse_assignment(item)
        cfg = _set(cfg, key.split("."), text, key)
    return cfg


def _set(obj: Any, path: list[str], text: str, key: str) -> Any:
    names = [f.name for f in dataclasses.fields(obj)]
    name = path[0]
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"unknown config key {key!r}{hint}; {type(obj).__name__} has: {', '.join(names)}"
        )
    current = getattr(obj, name)
    if len(path) > 1:
        if not dataclasses.is_dataclass(current):
            raise ConfigError(f"config key {key!r}: {name!r} has no sub-fields")
        value = _set(current, path[1:], text, key)
    else:
        value = parse_value(text, typing.get_type_hints(type(obj))[name], key)
    try:
        return dataclasses.replace(obj, **{name: value})
    except ValueError as e:  # a config's own validation
        raise ConfigError(f"--set {key}={text}: {e}") from None


def parse_value(text: str, tp: Any, key: str = "value") -> Any:
    """Convert ``text`` to the annotated type ``tp``: bool, int, float, str, ``X | None``,
    ``Literal[...]`` and tuples (comma-separated, ``tuple[X, ...]`` or fixed length)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and text.lower() in ("none", "null"):
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return parse_value(text, options[0], key)
        raise ConfigError(f"cannot --set {key}: unsupported field type {tp}")
    if origin is typing.Literal:
        for a in args:
            if str(a) == text:
                return a
        raise ConfigError(f"bad value for {key}: {text!r} is not one of {list(args)}")
    if origin is tuple:
        items = [t.strip() for t in text.split(",")] if text else []
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(parse_value(t, args[0], key) for t in items)
        if len(items) != len(args):
            raise ConfigError(f"bad value for {key}: expected {len(args)} comma-separated values")
        return tuple(parse_value(t, a, key) for t, a in zip(items, args, strict=True))
    if tp is bool:
        low = text.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"bad value for {key}: {text!r} is not a bool (true/false)")
    if tp in (int, float):
        try:
            return tp(text)
        except ValueError:
            kind = "an int" if tp is int else "a float"
            raise ConfigError(f"bad value for {key}: {text!r} is not {kind}") from None
    if tp is str:
        return text
    raise ConfigError(f"cannot --set {key}: unsupported field type {tp}")


def format_value(value: Any) -> str:
    """The ``--set`` spelling of a field value (inverse of `parse_value`)."""
    if isinstance(value, tuple):
        return ",".join(format_value(v) for v in value)
    return str(value)


def flatten(cfg: Any, prefix: str = "") -> list[tuple[str, str]]:
    """``(dotted key, --set spelling)`` for every field, nested dataclasses included."""
    rows = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            rows += flatten(value, f"{prefix}{f.name}.")
        else:
            rows.append((prefix + f.name, format_value(value)))
    return rows
