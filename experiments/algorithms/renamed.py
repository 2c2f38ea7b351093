"""Where the old names went (shoal 0.1): the flat config fields, before algorithms got
one module each (``diloco_sync_every`` is ``diloco.sync_every``), and the entries that
now carry the name of the `shoal.optim` transformation they run (``pgx`` is
``partial_exchange``). A config, entry or ``--set`` that uses an old name gets an error
naming the new spelling (`new_spelling`, `new_entry`).

Example:
  >>> new_spelling("diloco_sync_every", "diloco").split(":")[0]
  "'diloco_sync_every' is now diloco's own 'sync_every'"
  >>> new_entry("pgx")
  "algorithm 'pgx' is now 'partial_exchange', the name of the shoal.optim transformation it runs"
"""

from __future__ import annotations

_LOCAL = ("ssgd", "ssgd_noise", "gtc", "bfb_allreduce", "bmuf", "bmuf_gtc", "topk",
          "powersgd", "partial_exchange", "peer_averaging", "sma", "adaptive")  # fmt: skip
_BLOCK = ("bmuf", "bmuf_gtc")
_LAMB = ("lamb", "onebit_lamb", "onebit_adam")
_ONEBIT = ("onebit_lamb", "onebit_adam")
_DILOCO = ("diloco", "streaming_diloco")


def _each(names: tuple[str, ...], field: str) -> tuple[str, ...]:
    return tuple(f"{n}.{field}" for n in names)


# Old field -> its new homes, "algorithm.field" (dotted into parts).
RENAMED: dict[str, tuple[str, ...]] = {
    "learning_rate": (
        *_each(_LOCAL, "local.learning_rate"),
        *_each(_DILOCO, "inner.sgd.learning_rate"),
    ),  # fmt: skip
    "momentum": (*_each(_LOCAL, "local.momentum"), *_each(_DILOCO, "inner.sgd.momentum")),
    "lamb_learning_rate": _each(_LAMB, "learning_rate"),
    "lamb_b1": _each(_LAMB, "b1"),
    "lamb_b2": _each(_LAMB, "b2"),
    "weight_decay": (
        *_each(_LAMB, "weight_decay"),
        "ssgd_adamw.adamw.weight_decay",
        *_each(_DILOCO, "inner.adamw.weight_decay"),
    ),  # fmt: skip
    "lamb_lr_warmup": _each(_LAMB, "lr_warmup"),
    "lamb_lr_decay": _each(_LAMB, "lr_decay"),
    "onebit_freeze_fraction": _each(_ONEBIT, "freeze_fraction"),
    "onebit_freeze_step": _each(_ONEBIT, "freeze_step"),
    "gtc_threshold": ("gtc.threshold", "bmuf_gtc.threshold"),
    "gtc_capacity": ("gtc.capacity", "bmuf_gtc.capacity"),
    "block_size": _each(_BLOCK, "block_size"),
    "block_lr": _each(_BLOCK, "block_lr"),
    "block_momentum": _each(_BLOCK, "block_momentum"),
    "nesterov": _each(_BLOCK, "nesterov"),
    "nbm": _each(_BLOCK, "nbm"),
    "reset_inner_state": _each(_BLOCK, "reset_inner_state"),
    "warmup_steps": ("bmuf.warmup_steps",),
    "group_size": ("bmuf_gtc.group_size",),
    "diloco_sync_every": _each(_DILOCO, "sync_every"),
    "diloco_outer_lr": _each(_DILOCO, "outer.learning_rate"),
    "diloco_outer_momentum": _each(_DILOCO, "outer.momentum"),
    "diloco_inner": _each(_DILOCO, "inner.use"),
    "diloco_inner_lr": (
        *_each(_DILOCO, "inner.adamw.learning_rate"),
        "ssgd_adamw.adamw.learning_rate",
    ),  # fmt: skip
    "diloco_exchange": _each(_DILOCO, "exchange.codec"),
    "streaming_fragments": ("streaming_diloco.fragments",),
    "streaming_overlap": ("streaming_diloco.overlap",),
    "streaming_mix": ("streaming_diloco.mix",),
    "topk_fraction": ("topk.fraction", *_each(_DILOCO, "exchange.topk.fraction")),
    "topk_chunk_size": ("topk.chunk_size", *_each(_DILOCO, "exchange.topk.chunk_size")),
    "topk_value_bits": ("topk.value_bits", *_each(_DILOCO, "exchange.topk.value_bits")),
    "powersgd_rank": ("powersgd.rank",),
    "powersgd_start_step": ("powersgd.start_step",),
    "demo_momentum": ("demo.momentum",),
    "demo_chunk_size": ("demo.chunk_size",),
    "demo_topk": ("demo.topk",),
    "demo_sign": ("demo.sign",),
    "demo_lr": ("demo.learning_rate",),
    "bfb_buffer_bytes": ("bfb_allreduce.buffer_bytes",),
    "pgx_fraction": ("partial_exchange.fraction",),
    "peer_strategy": ("peer_averaging.strategy",),
    "peer_staleness": ("peer_averaging.staleness",),
    "sma_alpha": ("sma.alpha",),
    "noise_ema": ("ssgd_noise.ema", "adaptive.ema"),
    "policy_every": ("adaptive.every",),
    "policy_after": ("adaptive.after",),
    "noise_threshold": ("adaptive.threshold",),
    "adaptive_fraction": ("adaptive.fraction",),
    "adaptive_sync": ("adaptive.sync",),
}


# Old entry name -> the entry's name now: that of the `shoal.optim` transformation it runs.
RENAMED_ENTRIES: dict[str, str] = {
    "pgx": "partial_exchange",
    "peer": "peer_averaging",
    "bfb": "bfb_allreduce",
}


def new_entry(name: str) -> str | None:
    """The error text for the old entry name ``name`` (None when it is not one)."""
    new = RENAMED_ENTRIES.get(name)
    if new is None:
        return None
    return f"algorithm {name!r} is now {new!r}, the name of the shoal.optim transformation it runs"


def new_spelling(key: str, algorithm: str | None = None) -> str | None:
    """The error text for the old field ``key`` (None when it is not one): its new home
    in ``algorithm`` (a bracket of that algorithm's entry), else all its homes."""
    homes = RENAMED.get(key)
    if homes is None:
        return None
    if algorithm is not None:
        mine = [h.partition(".")[2] for h in homes if h.partition(".")[0] == algorithm]
        if mine:
            return (
                f"{key!r} is now {algorithm}'s own {mine[0]!r}: write "
                f"{algorithm}[{mine[0]}=...], or --set {algorithm}.{mine[0]}=... for the "
                "whole run"
            )
        return f"{key!r} is not a hyper-parameter of {algorithm} (it is now {', '.join(homes)})"
    return (
        f"config key {key!r} is now a hyper-parameter of each algorithm that uses it: "
        f"{', '.join(homes)} (--set {homes[0]}=..., an entry's brackets "
        f"{homes[0].partition('.')[0]}[{homes[0].partition('.')[2]}=...], or a config "
        f"file's params={{{homes[0].partition('.')[0]!r}: {{...}}}})"
    )
