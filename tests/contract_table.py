"""The contract table: one `Row` per transformation factory of `shoal.optim` (after
optax's ``contrib/_common_test.py``). The library-level contract tests read it:

- tests/test_contract_table.py: every public factory has a row, every row says what each
  contract below does with it (a case, or why it has none), and the shard_map job
  (tests/jobs/mesh_cases.py) calls every row's factory;
- tests/test_optax_contract.py: the parabola, ``inject_hyperparams``, the collective's
  type, a missing ``params``, a half-precision model under strict dtype promotion;
- tests/test_misuse.py and tests/test_integer_gradients.py: a gradient tree that does not
  match, a state of another transformation, an integer gradient;
- tests/test_nonfinite.py: `shoal.optim.skip_nonfinite` around every row, in its
  preferred skip mode too;
- tests/test_state_checkpoint.py: the state resumes from host copies, bit for bit;
- tests/test_docstrings.py: the docstring names the row's state.

A new transformation is one row here plus its oracle (its own test file). A builder takes
the workers' collective, or ``(intra, inter)`` for a two-tier row.

The compressed exchanges of `shoal.comms` (the codecs ``Quantized``, ``OneBit``, ``TopK``
and ``Float32`` of `shoal.comms.codecs`) are not optax transformations: they
average a flat float32 vector given their error-feedback memory, and their contracts are
in tests/test_compressors.py, test_compressed_allreduce.py and test_quantized_allreduce.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any

import optax
from harness import adamw

import shoal.optim as optim

LR = 0.05  # the optax contract's rate
NONFINITE_LR = 0.1  # the non-finite cases' rate
BMUF_STATIC = ("block_size", "nesterov", "nbm", "warmup_steps", "reset_inner_state")
# Decaying learning rates for the parabola where a step has a fixed size: the compressed
# momentum of 1-bit Adam/LAMB is +-scale (never 0), DeMo's step is sign(mean momentum):
# with a constant rate the iterate would keep jittering around the optimum.
DECAYING = optax.linear_schedule(0.05, 0.0, 1500)


@dataclasses.dataclass(frozen=True)
class Parabola:
    """optax's contract test: ``factory(collective=c, **kwargs)``, chained before ``then``
    when given, reaches the minimum of ``scale * |p - target|^2``."""

    kwargs: Mapping[str, Any]
    then: optax.GradientTransformation | None = None
    scale: float = 1.0
    # The state is initialised through optax.tree_utils.tree_map_params, as optax's test
    # does (init on a leafless placeholder of the params).
    tree_map_params: bool = True


@dataclasses.dataclass(frozen=True)
class Inject:
    """``optax.inject_hyperparams(factory, static_args=static)(collective=c, **kwargs)``
    makes the same step as ``factory(collective=c, **kwargs)``."""

    kwargs: Mapping[str, Any]
    static: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Row:
    """One transformation factory of `shoal.optim` and what its contracts need.

    ``build``: the transformation on a collective (``(intra, inter)`` when ``two_tier``),
    for the checks of its arguments, its state and its errors. ``nonfinite``: the
    transformation (with an optimizer after it when it transforms gradients) that the
    non-finite contract wraps in `shoal.optim.skip_nonfinite`. ``parabola`` and
    ``inject``: the optax contract's cases; a string instead of a case says why the row
    has none. ``skip_in_place``: the ``in_place`` a training step should give the
    `shoal.optim.skip_nonfinite` around it (None: the wrapper's own choice)."""

    name: str
    state: type
    build: Callable[[Any], optax.GradientTransformation]
    nonfinite: Callable[[Any], optax.GradientTransformation] | str
    parabola: Parabola | str
    inject: Inject | str
    two_tier: bool = False
    wraps: bool = False  # takes an inner optimizer (its first argument, ``inner``)
    needs_params: bool = False  # its update reads the model: refuses a missing params
    skip_in_place: bool | str | None = None
    # Wrapped and unwrapped finite steps agree within rounding, not bit for bit: XLA:CPU
    # contracts multiply-adds into FMAs differently in the two programs (tests/test_nonfinite.py).
    nonfinite_fma: bool = False

    @property
    def factory(self) -> Callable[..., optax.GradientTransformation]:
        return getattr(optim, self.name)


sgd = optax.sgd
momentum = lambda: optax.sgd(NONFINITE_LR, momentum=0.9)
then_sgd = lambda tx: optax.chain(tx, sgd(NONFINITE_LR))
nesterov = optax.sgd(0.7, momentum=0.9, nesterov=True)

ROWS = (
    Row(
        "allreduce_gradients",
        optim.AllReduceState,
        build=lambda c: optim.allreduce_gradients(collective=c),
        nonfinite=lambda c: then_sgd(optim.allreduce_gradients(collective=c)),
        parabola=Parabola({}, then=sgd(LR)),
        inject=Inject({}),
    ),
    Row(
        "bfb_allreduce",
        optim.BFBState,
        build=lambda c: optim.bfb_allreduce(collective=c, buffer_bytes=8),
        nonfinite=lambda c: then_sgd(optim.bfb_allreduce(collective=c, buffer_bytes=8)),
        parabola=Parabola({"buffer_bytes": 8}, then=sgd(LR)),
        inject=Inject({"buffer_bytes": 12}, ("buffer_bytes",)),
    ),
    Row(
        "bmuf",
        optim.BMUFState,
        build=lambda c: optim.bmuf(sgd(0.1), collective=c, block_size=2),
        nonfinite=lambda c: optim.bmuf(momentum(), collective=c, block_size=2),
        parabola=Parabola({"inner": sgd(LR), "block_size": 4}),
        inject=Inject({"inner": sgd(LR), "block_size": 1}, BMUF_STATIC),
        wraps=True,
        needs_params=True,
        skip_in_place="apply",
    ),
    Row(
        "bmuf_gtc",
        optim.BMUFState,
        build=lambda tiers: optim.bmuf_gtc(
            sgd(0.1), intra=tiers[0], inter=tiers[1], block_size=2, threshold=0.1
        ),
        nonfinite=lambda tiers: optim.bmuf_gtc(
            sgd(NONFINITE_LR),
            intra=tiers[0],
            inter=tiers[1],
            block_size=2,
            threshold=0.05,
            capacity=4,
        ),  # fmt: skip
        parabola="two tiers of workers: its convergence is tests/test_bmuf_gtc.py's oracle",
        inject="two collectives (intra, inter) and BMUF's hyper-parameters: bmuf's case",
        two_tier=True,
        wraps=True,
        needs_params=True,
        skip_in_place="apply",
    ),
    Row(
        "demo",
        optim.DeMoState,
        build=lambda c: optim.demo(collective=c, chunk_size=2, topk=1),
        nonfinite=lambda c: then_sgd(optim.demo(collective=c, chunk_size=2, topk=1)),
        parabola=Parabola({"chunk_size": 4, "topk": 2, "momentum": 0.9}, then=sgd(DECAYING)),
        inject=Inject({"chunk_size": 4, "topk": 2}, ("chunk_size", "topk", "sign")),
    ),
    Row(
        "desloc",
        optim.DESLOCState,
        build=lambda c: optim.desloc(1e-3, collective=c, sync_every=2),
        nonfinite=lambda c: optim.desloc(NONFINITE_LR, collective=c, sync_every=2),
        # No bias correction (the paper's equations): steps of about 3 lr at first, so a
        # decaying rate lets the iterate settle on the minimum.
        parabola=Parabola({"learning_rate": DECAYING, "sync_every": 2}),
        inject=Inject(
            {"learning_rate": 0.05, "sync_every": 2},
            ("sync_every", "moment_every", "second_moment_every"),
        ),
        needs_params=True,
        nonfinite_fma=True,
    ),
    Row(
        "diloco",
        optim.DiLoCoState,
        build=lambda c: optim.diloco(
            adamw(1e-3), collective=c, sync_every=2, outer=sgd(0.7, momentum=0.9)
        ),
        nonfinite=lambda c: optim.diloco(
            momentum(), collective=c, sync_every=2, outer=sgd(0.7, momentum=0.9)
        ),
        parabola=Parabola({"inner": sgd(LR), "outer": nesterov, "sync_every": 4}),
        inject=Inject({"inner": sgd(LR), "outer": sgd(1.0), "sync_every": 1}, ("sync_every",)),
        wraps=True,
        needs_params=True,
        skip_in_place="apply",
    ),
    Row(
        "gradient_noise_scale",
        optim.NoiseScaleState,
        build=lambda c: optim.gradient_noise_scale(collective=c, local_batch_size=4),
        nonfinite=lambda c: then_sgd(optim.gradient_noise_scale(collective=c, local_batch_size=4)),
        parabola=Parabola({"local_batch_size": 8}, then=sgd(LR)),
        inject=Inject({"local_batch_size": 8}),
        nonfinite_fma=True,
    ),
    Row(
        "gtc",
        optim.GTCState,
        build=lambda c: optim.gtc(0.1, collective=c, capacity=2),
        nonfinite=lambda c: then_sgd(optim.gtc(0.05, collective=c, capacity=4)),
        # GTC sends at most +-threshold per step and keeps the rest as a residual, which
        # acts like a large momentum when gradients dwarf the threshold: a flatter parabola.
        parabola=Parabola({"threshold": 0.05, "capacity": 1.0}, then=sgd(0.5), scale=0.01),
        inject=Inject({"threshold": 0.05, "capacity": 1.0}, ("capacity",)),
        skip_in_place=False,
    ),
    Row(
        "onebit_adam",
        optim.OneBitAdamState,
        build=lambda c: optim.onebit_adam(1e-2, collective=c, freeze_step=1),
        nonfinite=lambda c: optim.onebit_adam(1e-2, collective=c, freeze_step=2),
        parabola=Parabola({"learning_rate": DECAYING, "freeze_step": 300}),
        inject=Inject({"learning_rate": 0.01, "freeze_step": 1}, ("freeze_step",)),
        needs_params=True,
        skip_in_place="apply",
        nonfinite_fma=True,
    ),
    Row(
        "onebit_lamb",
        optim.OneBitLambState,
        build=lambda c: optim.onebit_lamb(1e-2, collective=c, freeze_step=1),
        nonfinite=lambda c: optim.onebit_lamb(1e-2, collective=c, freeze_step=2),
        parabola=Parabola({"learning_rate": DECAYING, "freeze_step": 300}),
        inject=Inject({"learning_rate": 0.01, "freeze_step": 1}, ("freeze_step",)),
        needs_params=True,
        skip_in_place="apply",
        nonfinite_fma=True,
    ),
    Row(
        "partial_exchange",
        optim.PartialExchangeState,
        build=lambda c: optim.partial_exchange(1.0, collective=c),
        nonfinite=lambda c: then_sgd(optim.partial_exchange(0.7, collective=c)),
        # One leaf here: only the whole tree fits a bin.
        parabola=Parabola({"budget_fraction": 1.0}, then=sgd(LR)),
        inject=Inject({"budget_fraction": 0.8}, ("budget_fraction",)),
        skip_in_place=True,
    ),
    Row(
        "peer_averaging",
        optim.PeerAveragingState,
        build=lambda c: optim.peer_averaging(sgd(0.1), collective=c),
        nonfinite=lambda c: optim.peer_averaging(
            momentum(), collective=c, strategy="random", staleness=1
        ),
        parabola=Parabola({"inner": sgd(LR), "strategy": "random", "staleness": 1}),
        inject=Inject(
            {"inner": sgd(LR), "strategy": "random", "staleness": 1},
            ("strategy", "staleness", "seed"),
        ),
        wraps=True,
        needs_params=True,
        skip_in_place="apply",
        nonfinite_fma=True,
    ),
    Row(
        "powersgd",
        optim.PowerSGDState,
        build=lambda c: optim.powersgd(1, collective=c),
        nonfinite=lambda c: then_sgd(
            optim.powersgd(1, collective=c, start_step=1, min_compression=1.0)
        ),
        parabola=Parabola({"rank": 1}, then=sgd(LR)),
        inject=Inject({"rank": 1}, ("rank", "start_step", "warm_start", "min_compression", "seed")),
    ),
    Row(
        "skip_nonfinite",
        optim.SkipNonFiniteState,
        build=lambda c: optim.skip_nonfinite(sgd(0.1), collective=c),
        nonfinite="the non-finite mechanism itself: every other row's case runs inside it",
        parabola=Parabola({"inner": sgd(LR)}),
        inject=Inject({"inner": sgd(LR)}, ("nonfinite", "in_place")),
        wraps=True,
    ),
    Row(
        "sma",
        optim.SMAState,
        build=lambda c: optim.sma(sgd(0.1), collective=c),
        nonfinite=lambda c: optim.sma(momentum(), collective=c),
        parabola=Parabola({"inner": sgd(LR), "alpha": 0.5}),
        inject=Inject({"inner": sgd(LR), "alpha": 0.5}),
        wraps=True,
        needs_params=True,
        skip_in_place="apply",
        nonfinite_fma=True,
    ),
    Row(
        "noloco",
        optim.NoLoCoState,
        build=lambda c: optim.noloco(adamw(1e-3), collective=c, sync_every=2),
        nonfinite=lambda c: optim.noloco(momentum(), collective=c, sync_every=2),
        parabola=Parabola({"inner": sgd(LR), "sync_every": 4}),
        inject=Inject({"inner": sgd(LR), "sync_every": 2, "gamma": 0.2}, ("sync_every", "seed")),
        wraps=True,
        needs_params=True,
    ),
    Row(
        "overlapped_diloco",
        optim.OverlappedDiLoCoState,
        build=lambda c: optim.overlapped_diloco(
            adamw(1e-3), collective=c, sync_every=2, outer=sgd(0.7, momentum=0.9)
        ),
        nonfinite=lambda c: optim.overlapped_diloco(
            momentum(), collective=c, sync_every=2, outer=sgd(0.7, momentum=0.9)
        ),
        parabola=Parabola({"inner": sgd(LR), "outer": nesterov, "sync_every": 4}),
        inject=Inject(
            {"inner": sgd(LR), "outer": sgd(1.0), "sync_every": 1}, ("sync_every", "variant")
        ),
        wraps=True,
        needs_params=True,
    ),
    Row(
        "sparseloco",
        optim.DiLoCoState,
        build=lambda c: optim.sparseloco(
            adamw(1e-3), collective=c, sync_every=2, density=0.5, chunk_size=2
        ),
        nonfinite=lambda c: optim.sparseloco(
            momentum(), collective=c, sync_every=2, density=0.5, chunk_size=2
        ),
        parabola=Parabola({"inner": sgd(LR), "sync_every": 4, "density": 0.5, "chunk_size": 2}),
        inject=Inject(
            {
                "inner": sgd(LR),
                "sync_every": 1,
                "outer_learning_rate": 0.8,
                "density": 0.5,
                "chunk_size": 2,
            },
            ("sync_every", "beta", "density", "chunk_size", "value_bits"),
        ),  # fmt: skip
        wraps=True,
        needs_params=True,
        skip_in_place="apply",
        nonfinite_fma=True,  # the decay's multiply-add, as diloco's exchange
    ),
    Row(
        "sparta",
        optim.SpartaState,
        build=lambda c: optim.sparta(adamw(1e-3), collective=c, fraction=0.5),
        nonfinite=lambda c: optim.sparta(momentum(), collective=c, fraction=0.5),
        parabola=Parabola({"inner": sgd(LR), "fraction": 0.5}),
        inject=Inject({"inner": sgd(LR), "fraction": 0.5}, ("fraction", "seed")),
        wraps=True,
        needs_params=True,
        nonfinite_fma=True,  # a picked entry's p + u, which XLA may contract with u's multiply
    ),
    Row(
        "streaming_diloco",
        optim.StreamingDiLoCoState,
        build=lambda c: optim.streaming_diloco(
            adamw(1e-3), collective=c, sync_every=2, outer=sgd(0.7), num_fragments=2
        ),
        nonfinite=lambda c: optim.streaming_diloco(
            momentum(), collective=c, sync_every=2, outer=sgd(0.7, momentum=0.9), num_fragments=2
        ),
        # One leaf here: one fragment. Its init splits the leaves into fragments, so
        # tree_map_params's leafless placeholder is refused ("num_fragments must be <=
        # the number of parameter leaves (0)"), as an empty tree is.
        parabola=Parabola(
            {"inner": sgd(LR), "outer": nesterov, "sync_every": 4, "num_fragments": 1},
            tree_map_params=False,
        ),
        inject=Inject(
            {"inner": sgd(LR), "outer": sgd(1.0), "sync_every": 1, "num_fragments": 1},
            ("sync_every", "num_fragments", "overlap", "mix"),
        ),
        wraps=True,
        needs_params=True,
    ),
    Row(
        "topk",
        optim.TopKState,
        build=lambda c: optim.topk(0.5, collective=c),
        nonfinite=lambda c: then_sgd(optim.topk(0.5, collective=c)),
        parabola=Parabola({"fraction": 0.5}, then=sgd(LR)),
        inject=Inject({"fraction": 0.5}, ("fraction", "chunk_size", "value_bits")),
    ),
)
TABLE: dict[str, Row] = {row.name: row for row in ROWS}


def public_factories() -> set[str]:
    """The names in ``shoal.optim.__all__`` of functions annotated to return an optax
    transformation: the factories that must have a row (the other exported functions,
    ``noise_scale``, ``partial_exchange_bins``, ``update_and_apply``..., read or run one)."""
    out = set()
    for name in optim.__all__:
        obj = getattr(optim, name)
        if not inspect.isfunction(obj):
            continue
        returns = typing.get_type_hints(obj).get("return")
        if inspect.isclass(returns) and issubclass(returns, optax.GradientTransformation):
            out.add(name)
    return out


def public_helpers() -> set[str]:
    """The other exported functions of `shoal.optim` (not transformation factories)."""
    functions = {n for n in optim.__all__ if inspect.isfunction(getattr(optim, n))}
    return functions - public_factories()


def rows(*, two_tier: bool | None = None, **flags: Any) -> list[str]:
    """The sorted names of the rows whose fields equal ``flags`` (e.g. ``needs_params=True``),
    restricted to one-tier (``two_tier=False``) or two-tier rows when given."""
    picked = [r for r in ROWS if all(getattr(r, k) == v for k, v in flags.items())]
    if two_tier is not None:
        picked = [r for r in picked if r.two_tier == two_tier]
    return sorted(r.name for r in picked)


def with_case(field: str) -> list[str]:
    """The sorted names of the rows that have a case for ``field`` (not a reason)."""
    return sorted(r.name for r in ROWS if not isinstance(getattr(r, field), str))
