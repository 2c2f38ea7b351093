"""Typed config fields and their checks: `check_types` (every field against its
annotation), `check_field`, `ConfigError`, and `TaskFields` (the task and its model), one of
the groups `shoal.experiments.config.Config` is made of.

The algorithms' hyper-parameters are not here: each algorithm's own module under
`shoal.experiments.algorithms` holds them, as a typed dataclass (``--set diloco.sync_every=20``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
import weakref
from collections.abc import Mapping
from typing import Any, Literal


class ConfigError(ValueError):
    """A config that cannot be loaded, an unknown key, or a value of the wrong type."""


def check_field(ok: Any, field: str, allowed: str) -> None:
    """Raise `ConfigError` naming ``field`` and what it must be, unless ``ok``."""
    if not ok:
        raise ConfigError(f"config field {field!r} must be {allowed}")


# Resolved annotations per dataclass: get_type_hints evaluates every string annotation.
_HINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # a subclass naming a type out of reach (a local class)
            # Keep what resolves (Config's own fields); leave the unresolvable ones unchecked.
            hints = {}
            for base in reversed(cls.__mro__):
                try:
                    hints.update(typing.get_type_hints(base))
                except Exception:
                    hints.update(dict.fromkeys(base.__dict__.get("__annotations__", {}), Any))
        _HINTS[cls] = hints
    return _HINTS[cls]


def check_types(obj: Any, prefix: str = "") -> None:
    """Check every field of the dataclass ``obj`` against its annotation, in place.

    int: an int, not a bool; float: an int or a float, finite, stored as float; bool; str;
    ``Literal[...]``; ``tuple[X, ...]`` (or fixed) from a tuple or list, never a str, stored
    as a tuple; ``X | None``; nested dataclasses (checked field by field). Raises
    `ConfigError` naming the field, the type expected and the value given.
    """
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = prefix + f.name
        conformed = _conform(value, hints.get(f.name, Any), name)
        if conformed is not value:
            object.__setattr__(obj, f.name, conformed)  # frozen: the field is not set yet


def from_mapping(cls: type, values: Mapping[str, Any], name: str = "") -> Any:
    """The dataclass ``cls`` made from ``values`` (its fields by name; nested dataclasses
    may be mappings too), checked; `ConfigError` naming an unknown key."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in values:
        if key not in names:
            where = f"{name}." if name else ""
            raise ConfigError(
                f"unknown config key {where + key!r}; {cls.__name__} has: {', '.join(names)}"
            )
    return cls(**values)


def rebuilt(obj: Any) -> Any:
    """The dataclass ``obj`` made again through its __init__, nested dataclasses first, so
    that every __post_init__ check runs on its final values."""
    nested = {
        f.name: rebuilt(getattr(obj, f.name))
        for f in dataclasses.fields(obj)
        if f.init
        and dataclasses.is_dataclass(getattr(obj, f.name))
        and not isinstance(getattr(obj, f.name), type)
    }
    return dataclasses.replace(obj, **nested)


class _Mismatch(Exception):
    """A value that does not fit its annotation (the caller names the field)."""


def _conform(value: Any, tp: Any, name: str) -> Any:
    try:
        return _fit(value, tp, name)
    except _Mismatch:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise ConfigError(
            f"config field {name!r} must be {_describe(tp)}, got {type(value).__name__} {shown}"
        ) from None


def _fit(value: Any, tp: Any, name: str) -> Any:
    """``value`` as annotated by ``tp`` (converted: list -> tuple, int -> float), or
    `_Mismatch`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or isinstance(tp, (str, typing.TypeVar)):
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in args:
            if option is not type(None):
                try:
                    return _fit(value, option, name)
                except _Mismatch:
                    pass
        raise _Mismatch
    if origin is Literal:
        # 1 is not True and 1.0 is not 1: the type must match too.
        for a in args:
            if value == a and type(value) is type(a):
                return a
        raise _Mismatch
    if tp is tuple or origin is tuple:
        if not isinstance(value, (tuple, list)):  # a str would be iterated letter by letter
            raise _Mismatch
        if not args:
            return tuple(value)
        if len(args) == 2 and args[1] is Ellipsis:
            items = [_fit(v, args[0], name) for v in value]
        elif len(args) == len(value):
            items = [_fit(v, a, name) for v, a in zip(value, args, strict=True)]
        else:
            raise _Mismatch
        same = isinstance(value, tuple) and all(a is b for a, b in zip(items, value, strict=True))
        return value if same else tuple(items)
    if tp is bool:
        if not isinstance(value, bool):
            raise _Mismatch
        return value
    if tp is int:
        # An int, not a bool (True would be 1); NumPy integers are ints.
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise _Mismatch
        return value if type(value) is int else int(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise _Mismatch
        # inf and nan pass every range check written as a comparison with nan, and reach
        # training: refuse them here, for every float field at once.
        if not math.isfinite(value):
            raise _Mismatch
        return value if type(value) is float else float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _Mismatch
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, Mapping):  # {"sync_every": 20}: the dataclass's fields by name
            return from_mapping(tp, value, name)
        if not isinstance(value, tp):
            raise _Mismatch
        check_types(value, prefix=f"{name}.")
        return value
    if isinstance(origin or tp, type) and not isinstance(value, origin or tp):
        raise _Mismatch
    return value


def _describe(tp: Any) -> str:
    """``tp`` in words: "an int", "a tuple (or list) of str", "a finite float or None"."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        words = [_describe(a) for a in args if a is not type(None)]
        return " or ".join(words + (["None"] if type(None) in args else []))
    if origin is Literal:
        return f"one of {list(args)}"
    if tp is tuple or origin is tuple:
        if not args:
            return "a tuple (or list)"
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a tuple (or list) of {_bare(args[0])}"
        return f"a tuple (or list) of {len(args)}: ({', '.join(_bare(a) for a in args)})"
    if tp is int:
        return "an int"
    if tp is float:
        return "a finite float"
    names = {bool: "a bool", str: "a str"}
    if tp in names:
        return names[tp]
    return f"a {getattr(origin or tp, '__name__', str(tp))}"


def _bare(tp: Any) -> str:
    """``tp`` without its article: "int", "finite float"."""
    words = _describe(tp)
    return words.split(" ", 1)[1] if words.startswith(("a ", "an ")) else words


def for_tasks(*tasks: str, default: Any) -> Any:
    """A `TaskFields` field that only the bundled ``tasks`` read: `TaskFields.fields_of`
    leaves it out for the others (their reports put it aside)."""
    return dataclasses.field(default=default, metadata={"tasks": tasks})


@dataclasses.dataclass(frozen=True)
class TaskFields:
    """The task, its data and its model (`shoal.experiments.tasks.make_task`). A field
    read by some bundled tasks only says which (`for_tasks`); the others every task reads."""

    # Task: "mixture", an MLP classifier on a Gaussian mixture (`shoal.experiments.tasks`),
    # or "hmm", an LSTM frame classifier on hidden-Markov sequences, a stand-in for
    # acoustic modelling (`shoal.experiments.tasks.acoustic`), or "lm", a byte-level transformer
    # language model on the Python standard library's source (`shoal.experiments.tasks.lm`),
    # "text", the same transformer at any size on installed text, with validation and test
    # files held out (`shoal.experiments.tasks.text`), or "images", a CNN on generated
    # 16x16 glyph images (`shoal.experiments.tasks.images`; cnn:
    # "small", two conv stages then dense layers of widths `hidden`, or "even", the same
    # network with its hidden layer stored as 16 column blocks: no leaf above 10%), or
    # your own: "module.path:factory" or "path/to/file.py:factory", a callable taking the
    # config and returning a `shoal.experiments.tasks.Task` (`--task`; a config file's
    # get_task(config) sets it). The names `shoal.experiments.tasks.register_task` knows.
    task: str = "mixture"
    # The seed the generated data is drawn from (None: the run's ``seed``; lm reads files).
    # ``--seeds`` pins it to the config's, so that every seed trains on the same data from
    # its own initial model and batch order (`Config.seeded`).
    data_seed: int | None = for_tasks("mixture", "hmm", "images", default=None)
    # Classes (mixture, images) or hidden states (hmm), and the feature dimension.
    num_classes: int = for_tasks("mixture", "hmm", "images", default=10)
    num_features: int = for_tasks("mixture", "hmm", default=32)
    # Gaussian components per class (mixture only), and the scale of the class or state
    # means relative to the unit noise (smaller is harder; 2 components at 0.6 give a
    # Bayes accuracy near 89%).
    components: int = for_tasks("mixture", default=2)
    class_sep: float = for_tasks("mixture", "hmm", default=0.6)
    # Points (mixture), sequences (hmm) or byte windows (lm).
    train_size: int = 8192
    test_size: int = 2048
    # Rows of the training set held out for validation (0: none): the task then trains on
    # the other train_size - validation_size rows and its evaluation reports on these in
    # place of the test set. ``shoal-run --sweep`` tunes on them, never on the test set.
    validation_size: int = 0
    # Hidden layer widths: MLP layers (mixture), stacked LSTM layers (hmm) or the CNN's
    # dense layers (images).
    hidden: tuple[int, ...] = for_tasks("mixture", "hmm", "images", default=(64, 64))
    # Frames per sequence (hmm) or bytes per example (lm); hmm only: the probability of
    # staying in a state (mean duration 1 / (1 - p) frames), and how many other states each
    # state can move to.
    seq_len: int = for_tasks("hmm", "lm", "text", default=32)
    hmm_self_loop: float = for_tasks("hmm", default=0.8)
    hmm_successors: int = for_tasks("hmm", default=4)
    # lm and text: transformer width, blocks and attention heads (heads must divide width).
    lm_width: int = for_tasks("lm", "text", default=64)
    lm_layers: int = for_tasks("lm", "text", default=2)
    lm_heads: int = for_tasks("lm", "text", default=4)
    # text only: which installed text (`shoal.experiments.tasks.text`): "stdlib" (the
    # standard library's top-level modules), "stdlib_tree" (all of its .py files) or
    # "installed" (those and site-packages' .py, .md, .rst and .txt files).
    text_corpus: Literal["stdlib", "stdlib_tree", "installed"] = for_tasks(
        "text", default="stdlib_tree"
    )
    cnn: Literal["small", "even"] = for_tasks("images", default="small")

    @classmethod
    def fields_of(cls, task: str) -> tuple[str, ...]:
        """The fields the task ``task`` reads: every field but those declared for other
        bundled tasks only (`for_tasks`); for a task of your own, the fields every task reads.

        Example:
          >>> "lm_width" in TaskFields.fields_of("lm"), "lm_width" in TaskFields.fields_of("hmm")
          (True, False)
        """
        return tuple(
            f.name for f in dataclasses.fields(cls) if task in f.metadata.get("tasks", (task,))
        )

    def check_task(self) -> None:
        """`ConfigError` for a task field out of range."""
        for f in ("num_features", "components", "train_size", "test_size", "seq_len",
                  "hmm_successors", "lm_width", "lm_layers", "lm_heads"):  # fmt: skip
            check_field(getattr(self, f) >= 1, f, "an int >= 1")
        check_field(self.num_classes >= 2, "num_classes", "an int >= 2")
        check_field(
            0 <= self.validation_size < self.train_size,
            "validation_size",
            f"an int in [0, train_size = {self.train_size}) (0: no validation split)",
        )
        check_field(all(h >= 1 for h in self.hidden), "hidden", "layer widths >= 1")
        check_field(self.class_sep > 0, "class_sep", "a float > 0")
        check_field(
            self.lm_width % self.lm_heads == 0,
            "lm_heads",
            f"a divisor of lm_width = {self.lm_width}",
        )
        if self.task == "hmm":
            check_field(
                self.hmm_successors < self.num_classes,
                "hmm_successors",
                f"less than num_classes = {self.num_classes} (the successors are other states)",
            )
        check_field(0 <= self.hmm_self_loop < 1, "hmm_self_loop", "a float in [0, 1)")
