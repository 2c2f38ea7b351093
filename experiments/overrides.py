"""Reading configs: loading a config file, and ``--set key=value`` overrides.

A config file under ``experiments/configs/`` defines ``get_config()`` returning a
`Config` (or a subclass with extra fields), or a study or an analysis. ``--set key=value``
converts ``value`` with the field's type annotation; nested dataclass fields take dotted
keys, and an algorithm's hyper-parameters its name first (``--set
diloco.outer.learning_rate=0.5``: ``Config.params``); `flatten` writes a config's fields
back in that spelling.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib.util
import os
import re
import sys
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shoal.experiments.config import Config, ConfigError
from shoal.experiments.fields import rebuilt

CONFIGS = Path(__file__).parent / "configs"


def is_path(spec: str | Path) -> bool:
    """Whether the CONFIG ``spec`` names a file (it ends in ``.py`` or holds a path
    separator); otherwise it is the name of a bundled config."""
    text = str(spec)
    return text.endswith(".py") or any(s and s in text for s in ("/", os.sep, os.altsep))


def config_path(spec: str | Path) -> Path:
    """The file of the CONFIG ``spec`` (`is_path`: a path, else a bundled config's
    name); `ConfigError` when there is none."""
    if not is_path(spec):
        # Only the bundled folder: a file of that name here is not a config (no .py).
        path = CONFIGS / f"{spec}.py"
        if str(spec).startswith("_") or not path.is_file():
            raise ConfigError(f"config file not found: {spec}")
        return path
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"config file not found: {spec}")
    if path.suffix != ".py":  # importlib cannot load it as a module
        raise ConfigError(f"{spec}: config files end in .py")
    return path


def load_file(spec: str | Path) -> Any:
    """Run ``get_config()`` from a config file and return what it returns (a `Config`, or
    a `shoal.experiments.runner.study.Study`).

    ``spec`` is a path to a ``.py`` file, or the bare name of a bundled config
    (``"quickstart"`` for ``experiments/configs/quickstart.py``); see `config_path`.
    An unknown field (``Config(foo=1)``) is the `ConfigError` of ``--set foo=1``.
    """
    path = config_path(spec)
    module = load_module(path, fresh=True)
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
        raise ConfigError(f"{path} does not define get_config()")
    try:
        loaded = get_config()
    except TypeError as e:
        error = _unknown_field(e, module.__name__)
        if error is None:  # the user's own code: its traceback is what helps
            raise
        raise ConfigError(f"{path}: {error}") from None
    if callable(getattr(module, "get_task", None)):
        # The file's own task: named by the file, so every process (and a resumed run's
        # compatibility check) finds the same one.
        loaded = _with_task(loaded, f"{path}:get_task")
    return loaded


def _with_task(loaded: Any, spec: str) -> Any:
    """``loaded`` (a `Config`, or a study of one) training on the task ``spec``."""
    if isinstance(loaded, Config):
        return dataclasses.replace(loaded, task=spec)
    inner = getattr(loaded, "config", None)
    if isinstance(inner, Config):
        return dataclasses.replace(loaded, config=dataclasses.replace(inner, task=spec))
    return loaded


def load_module(path: str | Path, fresh: bool = False) -> types.ModuleType:
    """The module of the Python file ``path``, run once in this process (again when it
    changed on disk, or with ``fresh``). Registered in ``sys.modules`` so that
    ``typing.get_type_hints`` resolves a config subclass's annotations."""
    path = Path(path)
    name = f"_shoal_config_{path.stem}"
    stamp = (str(path.resolve()), path.stat().st_mtime_ns)
    module = sys.modules.get(name)
    if not fresh and module is not None and getattr(module, "__shoal_stamp__", None) == stamp:
        return module
    spec_ = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec_)
    module.__shoal_stamp__ = stamp
    sys.modules[name] = module
    spec_.loader.exec_module(module)
    return module


# What a dataclass __init__ (also through dataclasses.replace) says of an unknown keyword.
_UNEXPECTED = re.compile(r"([\w.<>]+)\.__init__\(\) got an unexpected keyword argument '(\w+)'")


def _unknown_field(error: TypeError, module: str) -> str | None:
    """The unknown-key message of ``--set`` for a `Config` (or subclass) constructed with
    a keyword that is not one of its fields; None for any other TypeError."""
    match = _UNEXPECTED.fullmatch(str(error))
    if match is None:
        return None
    qualname, key = match.groups()
    classes, seen = [Config], []
    while classes:  # Config and every subclass of it defined so far
        cls = classes.pop()
        seen.append(cls)
        classes += cls.__subclasses__()
    found = [c for c in seen if c.__qualname__ == qualname]
    if not found:
        return None
    # Two config files may both define a MyConfig: prefer the one just loaded.
    cls = next((c for c in found if c.__module__ == module), found[-1])
    return _unknown_key(cls, key, key)


def _unknown_key(cls: type, name: str, key: str) -> str:
    if issubclass(cls, Config):
        from shoal.experiments.algorithms.renamed import new_entry, new_spelling

        moved = new_spelling(name) or new_entry(name)
        if moved:
            return moved
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown config key {key!r}{hint}; {cls.__name__} has: {', '.join(names)}"


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


def apply_overrides(cfg: Any, assignments: Iterable[str | tuple[str, str]], **fields: Any) -> Any:
    """Apply ``key=value`` strings (or `parse_assignment` pairs) in order, then ``fields``
    (typed values, such as the run's worker count), and check the result once: the
    config's checks see every change together, so their order does not matter
    (``inject_nonfinite=1:10 workers=16`` is ``workers=16 inject_nonfinite=1:10``).
    Raises `ConfigError` naming the bad key or value."""
    items = [item if isinstance(item, tuple) else parse_assignment(item) for item in assignments]
    out = cfg
    for key, text in items:
        out = _set(out, key.split("."), text, key)
    for name, value in fields.items():
        if name not in {f.name for f in dataclasses.fields(out)}:
            raise ConfigError(_unknown_key(type(out), name, name))
        out = _unchecked_replace(out, name, value)
    if out is cfg:
        return cfg
    try:
        return rebuilt(out)
    except ValueError as e:  # a config's own validation
        raise ConfigError(f"{_blame(str(e), items, fields)}{e}") from None


def _blame(message: str, items: list[tuple[str, str]], fields: dict[str, Any]) -> str:
    """The prefix naming what led to ``message``: the assignments whose fields it names,
    else the typed fields, else every assignment."""
    last = dict(items)  # a key set twice: its last value is the one checked
    named = [
        f"{k}={t}" for k, t in last.items() if any(f"'{p}'" in message for p in (k, *k.split(".")))
    ]
    if named:
        return f"--set {' '.join(named)}: "
    if fields:
        return f"with {', '.join(f'{k} = {v}' for k, v in fields.items())}: "
    return f"--set {' '.join(f'{k}={t}' for k, t in last.items())}: " if last else ""


def _unchecked_replace(obj: Any, name: str, value: Any) -> Any:
    """``obj`` with ``name`` set, its checks not run yet (`rebuilt` runs them once every
    change is in)."""
    new = copy.copy(obj)
    object.__setattr__(new, name, value)  # frozen dataclasses too
    return new


def _set(obj: Any, path: list[str], text: str, key: str) -> Any:
    names = [f.name for f in dataclasses.fields(obj)]
    name = path[0]
    if name not in names and isinstance(obj, Config):
        from shoal.experiments.algorithms import ALGORITHMS

        if name in ALGORITHMS:  # an algorithm's hyper-parameter: Config.params
            if len(path) == 1:
                raise ConfigError(
                    f"config key {key!r} names an algorithm: set one of its fields, e.g. "
                    f"--set {name}.{dataclasses.fields(ALGORITHMS[name].params)[0].name}=..."
                )
            current = obj.params.get(name) or ALGORITHMS[name].params()
            value = _set(current, path[1:], text, key)
            return _unchecked_replace(obj, "params", {**obj.params, name: value})
    if name not in names:
        raise ConfigError(_unknown_key(type(obj), name, key))
    current = getattr(obj, name)
    if len(path) > 1:
        if not dataclasses.is_dataclass(current):
            raise ConfigError(f"config key {key!r}: {name!r} has no sub-fields")
        value = _set(current, path[1:], text, key)
    else:
        value = parse_value(text, typing.get_type_hints(type(obj))[name], key)
    return _unchecked_replace(obj, name, value)


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
    """``(dotted key, --set spelling)`` for every field, nested dataclasses included; a
    config's ``params`` as ``algorithm.field``."""
    rows = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(cfg, Config) and f.name == "params":
            for name, params in sorted(value.items()):
                rows += flatten(params, f"{prefix}{name}.")
        elif dataclasses.is_dataclass(value):
            rows += flatten(value, f"{prefix}{f.name}.")
        else:
            rows.append((prefix + f.name, format_value(value)))
    return rows
