"""The field groups `shoal.experiments.config.Config` is made of, each with its checks:
`TaskFields` (the task and its model) and `HyperParameters` (the local optimizer and the
bundled algorithms' hyper-parameters, read by `shoal.experiments.builders`).

Every field is a flat ``--set`` key (``--set gtc_threshold=0.05``); the groups only say
which concern a field belongs to and keep its checks beside it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
import weakref
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


@dataclasses.dataclass(frozen=True)
class TaskFields:
    """The task, its data and its model (`shoal.experiments.tasks.make_task`)."""

    # Task: "mixture", an MLP classifier on a Gaussian mixture (`shoal.experiments.tasks`),
    # or "hmm", an LSTM frame classifier on hidden-Markov sequences, a stand-in for
    # acoustic modelling (`shoal.experiments.tasks.acoustic`), or "lm", a byte-level transformer
    # language model on the Python standard library's source (`shoal.experiments.tasks.lm`), or
    # "images", a CNN on generated 16x16 glyph images (`shoal.experiments.tasks.images`; cnn:
    # "small", two conv stages then dense layers of widths `hidden`, or "even", the same
    # network with its hidden layer stored as 16 column blocks: no leaf above 10%), or
    # your own: "module.path:factory" or "path/to/file.py:factory", a callable taking the
    # config and returning a `shoal.experiments.tasks.Task` (`--task`; a config file's
    # get_task(config) sets it). The names `shoal.experiments.tasks.register_task` knows.
    task: str = "mixture"
    # Classes (mixture) or hidden states (hmm), and the feature dimension.
    num_classes: int = 10
    num_features: int = 32
    # Gaussian components per class (mixture only), and the scale of the class or state
    # means relative to the unit noise (smaller is harder; 2 components at 0.6 give a
    # Bayes accuracy near 89%).
    components: int = 2
    class_sep: float = 0.6
    # Points (mixture), sequences (hmm) or byte windows (lm).
    train_size: int = 8192
    test_size: int = 2048
    # Hidden layer widths: MLP layers (mixture) or stacked LSTM layers (hmm).
    hidden: tuple[int, ...] = (64, 64)
    # Frames per sequence (hmm) or bytes per example (lm); hmm only: the probability of
    # staying in a state (mean duration 1 / (1 - p) frames), and how many other states each
    # state can move to.
    seq_len: int = 32
    hmm_self_loop: float = 0.8
    hmm_successors: int = 4
    # lm only: transformer width, blocks and attention heads (heads must divide width).
    lm_width: int = 64
    lm_layers: int = 2
    lm_heads: int = 4
    cnn: Literal["small", "even"] = "small"

    def check_task(self) -> None:
        """`ConfigError` for a task field out of range."""
        for f in ("num_features", "components", "train_size", "test_size", "seq_len",
                  "hmm_successors", "lm_width", "lm_layers", "lm_heads"):  # fmt: skip
            check_field(getattr(self, f) >= 1, f, "an int >= 1")
        check_field(self.num_classes >= 2, "num_classes", "an int >= 2")
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


@dataclasses.dataclass(frozen=True)
class HyperParameters:
    """The local optimizer and the bundled algorithms' hyper-parameters.

    An algorithm's transformation checks its own hyper-parameters when
    `shoal.experiments.algorithms.resolve` makes it (one source of truth); `check_hyper`
    checks only the knobs of the optimizers the builders chain (learning rates, DiLoCo's
    outer step), which no transformation sees whole, and the runner's (block and group
    sizes, the adaptive policy).
    """

    # Local optimizer shared by the algorithms (SGD with heavy-ball momentum).
    learning_rate: float = 0.05
    momentum: float = 0.9

    # LAMB and 1-bit LAMB (`shoal.optim.onebit_lamb`), full optimizers on the workers'
    # local gradients: peak learning rate, moment decays, decoupled weight decay, and
    # the schedule: linear warm-up over lamb_lr_warmup * steps, then constant or decay
    # (cosine or linear) to 0 after the last step. 1-bit LAMB's warm-up stage (dense
    # all-reduce) lasts onebit_freeze_step steps, or round(onebit_freeze_fraction * steps)
    # when that is None; "lamb" is the warm-up stage for every step.
    lamb_learning_rate: float = 0.02
    lamb_b1: float = 0.9
    lamb_b2: float = 0.999
    weight_decay: float = 0.0
    lamb_lr_warmup: float = 0.0
    lamb_lr_decay: Literal["constant", "cosine", "linear"] = "constant"
    onebit_freeze_fraction: float = 0.15
    onebit_freeze_step: int | None = None

    # GTC (`shoal.optim.gtc`): threshold tau, and words per worker per step as a
    # fraction of the parameters.
    gtc_threshold: float = 0.1
    gtc_capacity: float = 0.08

    # BMUF (`shoal.optim.bmuf`) and two-tier BMUF_GTC (`shoal.optim.bmuf_gtc`, which also
    # reads gtc_threshold and gtc_capacity): local steps per block, block learning rate
    # zeta, block momentum eta (None: eq. 5 with C = 1, eta = 1 - zeta / M for the M
    # models averaged: M = workers for bmuf, workers / group_size for bmuf_gtc), Nesterov
    # block momentum and its variant, S-SGD warm-up steps (bmuf only), and whether the
    # local optimizer's momentum restarts after every BMUF step.
    block_size: int = 10
    block_lr: float = 1.0
    block_momentum: float | None = None
    nesterov: bool = True
    nbm: Literal["seed", "chen_huo"] = "seed"
    warmup_steps: int = 0
    reset_inner_state: bool = True
    # BMUF_GTC: workers per group P (consecutive workers; must divide workers).
    group_size: int = 2

    # DiLoCo (`shoal.optim.diloco`): updates per round (the outer step runs every
    # diloco_sync_every updates; steps must be a multiple of it, so that the last step is
    # an outer step), the outer Nesterov SGD's learning rate and momentum (the paper's 0.7
    # and 0.9), and the inner optimizer: "adamw" (the paper's; learning rate
    # diloco_inner_lr, decoupled weight decay weight_decay) or "sgd" (the local optimizer
    # of the other algorithms: learning_rate, momentum). Its state is never reset.
    diloco_sync_every: int = 10
    diloco_outer_lr: float = 0.7
    diloco_outer_momentum: float = 0.9
    diloco_inner: Literal["adamw", "sgd"] = "adamw"
    diloco_inner_lr: float = 1e-3
    # The exchange of DiLoCo's outer gradient (`diloco`, `streaming_diloco`): "float32"
    # (an all-reduce), "int8" / "fp8" / "fp4" (`shoal.comms.Quantized`, blocks of 128,
    # error feedback) or "topk" (`shoal.comms.TopK` with topk_fraction, topk_chunk_size
    # and topk_value_bits: SparseLoCo's exchange).
    diloco_exchange: Literal["float32", "int8", "fp8", "fp4", "topk"] = "float32"
    # Streaming DiLoCo (`shoal.optim.streaming_diloco`, with the diloco_* fields above):
    # fragments syncing in turn, the steps an outer update waits before it is merged
    # (overlap tau), and the merge's weight on the local model (mix).
    streaming_fragments: int = 4
    streaming_overlap: int = 0
    streaming_mix: float = 0.5

    # Top-k with error feedback (`shoal.optim.topk`, then `local_sgd`; also DiLoCo's "topk"
    # exchange): the share of each chunk of topk_chunk_size values sent, and the bits of
    # each sent value (0: float32).
    topk_fraction: float = 0.01
    topk_chunk_size: int = 64
    topk_value_bits: Literal[0, 2, 4, 8] = 0
    # PowerSGD (`shoal.optim.powersgd`, then `local_sgd`): rank and plain all-reduce steps.
    powersgd_rank: int = 4
    powersgd_start_step: int = 0
    # DeMo (`shoal.optim.demo`, then SGD at demo_lr without momentum): momentum decay,
    # DCT chunk size, coefficients sent per chunk, and sign of the update.
    demo_momentum: float = 0.999
    demo_chunk_size: int = 64
    demo_topk: int = 32
    demo_sign: bool = True
    demo_lr: float = 1e-3

    # Herring's balanced fusion buffers (`shoal.optim.bfb_allreduce`): bytes per buffer
    # (0: automatic). Dedicated server ranks come from `shoal-run --servers S`.
    bfb_buffer_bytes: int = 0

    # KungFu (`shoal.optim`): partial gradient exchange fraction of the gradient bytes per
    # step (pgx), peer model averaging strategy and staleness (peer), synchronous model
    # averaging rate (sma), and the EMA of the gradient noise scale monitor.
    pgx_fraction: float = 0.3
    peer_strategy: Literal["round_robin", "random"] = "round_robin"
    peer_staleness: int = 0
    sma_alpha: float = 0.1
    noise_ema: float = 0.9

    # Closed-loop adaptation (`shoal.experiments.runner.policies`, algorithm "adaptive"): every
    # policy_every steps the policy may change the synchronisation; "adaptive" exchanges all
    # gradients (monitoring the noise scale) until the median noise scale of the last
    # policy_every steps exceeds noise_threshold, then a fraction adaptive_fraction (PGX).
    # The policy is not consulted before step policy_after (early noise estimates swing).
    policy_every: int = 10
    policy_after: int = 0
    noise_threshold: float = 1000.0
    adaptive_fraction: float = 0.1
    adaptive_sync: Literal["full", "partial"] = "full"

    def check_hyper(self) -> None:
        """`ConfigError` for a hyper-parameter that no transformation checks."""
        for f in ("block_size", "group_size", "policy_every"):
            check_field(getattr(self, f) >= 1, f, "an int >= 1")
        check_field(self.policy_after >= 0, "policy_after", "an int >= 0")
        check_field(0 < self.adaptive_fraction <= 1, "adaptive_fraction", "a float in (0, 1]")
        check_field(self.learning_rate > 0, "learning_rate", "a float > 0")
        check_field(0 <= self.momentum < 1, "momentum", "a float in [0, 1)")
        check_field(self.lamb_learning_rate > 0, "lamb_learning_rate", "a float > 0")
        # Also AdamW's (ssgd_adamw, DiLoCo's inner step), which optax does not check.
        check_field(self.weight_decay >= 0, "weight_decay", "a float >= 0")
        check_field(0 <= self.lamb_lr_warmup < 1, "lamb_lr_warmup", "a float in [0, 1)")
        check_field(
            0 < self.onebit_freeze_fraction < 1, "onebit_freeze_fraction", "a float in (0, 1)"
        )
        check_field(
            self.onebit_freeze_step is None or self.onebit_freeze_step >= 1,
            "onebit_freeze_step",
            "None (from onebit_freeze_fraction) or an int >= 1",
        )
        check_field(self.block_lr > 0, "block_lr", "a float > 0")
        check_field(self.warmup_steps >= 0, "warmup_steps", "an int >= 0")
        check_field(self.diloco_sync_every >= 1, "diloco_sync_every", "an int >= 1")
        check_field(
            0 < self.diloco_outer_lr < float("inf"), "diloco_outer_lr", "a finite float > 0"
        )
        check_field(
            0 <= self.diloco_outer_momentum < 1, "diloco_outer_momentum", "a float in [0, 1)"
        )
        check_field(self.diloco_inner in ("adamw", "sgd"), "diloco_inner", '"adamw" or "sgd"')
        check_field(self.diloco_inner_lr > 0, "diloco_inner_lr", "a float > 0")
        exchanges = ("float32", "int8", "fp8", "fp4", "topk")
        check_field(self.diloco_exchange in exchanges, "diloco_exchange", f"one of {exchanges}")
        check_field(
            0 <= self.streaming_overlap < self.diloco_sync_every,
            "streaming_overlap",
            f"an int in [0, diloco_sync_every = {self.diloco_sync_every})",
        )
        check_field(self.demo_lr > 0, "demo_lr", "a float > 0")
