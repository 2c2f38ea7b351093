"""Herring's Table III on BERT-large's shapes: what the server holding the embedding
gradient receives while a buffer containing it is reduced, under atomic placement (each
variable whole on one server) versus balanced fusion buffers (BFB) of the paper's
86684 KB, for 8 to 64 worker nodes with as many servers.

Thangakrishnan et al., "Herring: Rethinking the Parameter Server at Scale for the Cloud"
(SC 2020), section III, Tables II-III and Fig. 1. Everything is computed from shapes
(`jax.eval_shape` of `shoal.experiments.tasks.bert`, fp16) and the production order of the
MLM + NSP loss's gradients (`shoal.comms.gradient_order`), with `plan_fusion` and
`atomic_placement`; nothing is allocated or trained. Run with
``shoal-run experiments/configs/herring_table3.py`` (about 4 s on an idle 2-core CPU, half
of it tracing BERT-large's backward pass); it writes ``runs/herring_table3/``: ``table3.csv``,
``per_server_64.csv``, ``per_server_64.png`` and ``summary.md``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from shoal.comms.fusion import (
    BUFFERS_PER_STEP,
    atomic_placement,
    auto_buffer_bytes,
    plan_fusion,
)
from shoal.experiments.runner.analysis import Analysis, markdown_table, write_rows_csv
from shoal.experiments.tasks import bert

NODES = (8, 16, 32, 64)  # worker nodes, with as many servers
PAPER_BUFFER_KB = 86684
BUFFER_BYTES = PAPER_BUFFER_KB * 1024
PLOT_SERVERS = 64
MIB = 2**20  # the paper's "MB": 8 x 61056 KB / 1024 = 477
EMBEDDING = "word_embeddings/embedding"

# The paper's numbers.
PAPER_ATOMIC_MB = {8: 477, 16: 954, 32: 1908, 64: 3816}
PAPER_BFB_MB = 84.6
PAPER_VARIABLES = 398
PAPER_EMBEDDING = (30528, 1024)  # 31260672 elements: NVIDIA pads the vocabulary to 8k
# Table II, first produced first: (variable index, gradient length). The indices are the
# TF/NVIDIA variable order; PAPER_NAMES maps them to our leaves.
PAPER_TABLE2 = ((17, 4194304), (16, 4096), (15, 4194304), (13, 1024), (14, 1024),
                (12, 1024), (11, 1048576), (10, 1024), (9, 1048576), (8, 1024),
                (7, 1048576), (6, 1024), (5, 1048576), (3, 1024), (4, 1024), (2, 2048),
                (1, 524288), (0, 31260672))  # fmt: skip
PAPER_NAMES = {
    0: EMBEDDING,
    1: "position_embeddings/embedding",
    2: "token_type_embeddings/embedding",
    3: "embeddings_layer_norm/bias",  # LayerNorm beta
    4: "embeddings_layer_norm/scale",  # gamma
    5: "layer_0/attention/query/kernel",
    6: "layer_0/attention/query/bias",
    7: "layer_0/attention/key/kernel",
    8: "layer_0/attention/key/bias",
    9: "layer_0/attention/value/kernel",
    10: "layer_0/attention/value/bias",
    11: "layer_0/attention_output/kernel",
    12: "layer_0/attention_output/bias",
    13: "layer_0/attention_layer_norm/bias",
    14: "layer_0/attention_layer_norm/scale",
    15: "layer_0/intermediate/kernel",
    16: "layer_0/intermediate/bias",
    17: "layer_0/output/kernel",
}


def embedding_leaf(shapes: Any) -> int:
    """Leaf index of the word embedding."""
    return bert.leaf_names(shapes).index(EMBEDDING)


def embedding_load(
    shapes: Any, order: Sequence[int], nodes: int, buffer_bytes: int = BUFFER_BYTES
) -> tuple[int, int]:
    """Bytes the server holding (part of) the embedding gradient receives from ``nodes``
    workers while one buffer containing it is reduced, with ``nodes`` servers:
    ``(atomic, bfb)``. Atomic: the embedding is one variable on one server, which receives
    it whole from every worker. BFB: that server receives one shard of the buffer from
    every worker; the embedding may straddle buffers, and the largest is reported."""
    leaf = embedding_leaf(shapes)
    atomic = atomic_placement(shapes, num_servers=nodes, order=order)
    plan = plan_fusion(shapes, buffer_bytes=buffer_bytes, num_shards=nodes, order=order)
    holding = [b for b in range(plan.num_buffers) if leaf in plan.buffer_leaves(b)]
    return nodes * atomic.leaf_bytes[leaf], nodes * max(plan.shard_bytes[b] for b in holding)


def table3(
    shapes: Any, order: Sequence[int], nodes: Sequence[int] = NODES,
    buffer_bytes: int = BUFFER_BYTES,
) -> list[dict[str, Any]]:  # fmt: skip
    """Rows ``{nodes, atomic_mb, bfb_mb}`` (MiB, as the paper's MB)."""
    rows = []
    for n in nodes:
        atomic, bfb = embedding_load(shapes, order, n, buffer_bytes)
        rows.append({"nodes": n, "atomic_mb": atomic / MIB, "bfb_mb": bfb / MIB})
    return rows


def per_server(
    shapes: Any, order: Sequence[int], servers: int = PLOT_SERVERS,
    buffer_bytes: int = BUFFER_BYTES,
) -> list[dict[str, int]]:  # fmt: skip
    """Bytes each of ``servers`` servers receives per iteration from as many workers:
    atomic (round-robin in production order) and BFB, whose gradient bytes and zero
    padding (the tail of the last buffer's last shard) are separate columns."""
    atomic = atomic_placement(shapes, num_servers=servers, order=order)
    plan = plan_fusion(shapes, buffer_bytes=buffer_bytes, num_shards=servers, order=order)
    item = plan.dtype.itemsize
    payload, padding = np.zeros(servers, np.int64), np.zeros(servers, np.int64)
    for size, k in zip(plan.buffer_sizes, plan.shard_sizes):
        starts = np.arange(servers) * k
        real = np.clip(size - starts, 0, k)  # elements of shard s that hold gradients
        payload += real * item
        padding += (k - real) * item
    return [
        {
            "server": s,
            "atomic_bytes": servers * atomic.server_bytes[s],
            "bfb_bytes": servers * int(payload[s]),
            "bfb_padding_bytes": servers * int(padding[s]),
        }
        for s in range(servers)
    ]


def plot_per_server(
    path: Path, rows: Sequence[dict[str, int]], embedding_server: int, model: str = "BERT-large"
) -> None:
    """MiB each server receives per iteration, atomic (bars) against BFB (line)."""
    fig = Figure(figsize=(7.0, 3.4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    s = np.array([r["server"] for r in rows])
    atomic = np.array([r["atomic_bytes"] for r in rows]) / MIB
    bfb = np.array([r["bfb_bytes"] + r["bfb_padding_bytes"] for r in rows]) / MIB
    colors = ["C3" if i == embedding_server else "C0" for i in s]
    ax.bar(s, atomic, width=0.8, color=colors, label="atomic placement (red: the embedding's)")
    ax.step(s, bfb, where="mid", color="C1", lw=2, label="balanced fusion buffers")
    ax.set_xlabel(f"server ({len(rows)} servers, {len(rows)} workers)")
    ax.set_ylabel("MiB received per iteration")
    ax.set_title(f"{model} fp16 gradients: per-server load", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=90)


def analyse(out_dir: Path, config: bert.BertConfig = bert.BERT_LARGE) -> str:
    """Write table3.csv, per_server_64.csv and per_server_64.png; return the summary."""
    t0 = time.perf_counter()
    shapes = bert.param_shapes(config)
    t_shapes = time.perf_counter() - t0
    t0 = time.perf_counter()
    order = bert.production_order(config)
    t_order = time.perf_counter() - t0

    leaves = jax.tree.leaves(shapes)
    names = bert.leaf_names(shapes)
    emb = embedding_leaf(shapes)
    n_params = bert.num_parameters(shapes)
    item = np.dtype(leaves[emb].dtype).itemsize
    total_bytes = n_params * item
    emb_bytes = math.prod(leaves[emb].shape) * item

    rows = table3(shapes, order)
    write_rows_csv(out_dir / "table3.csv", rows, "{:.6f}")
    servers = per_server(shapes, order)
    emb_server = atomic_placement(shapes, num_servers=PLOT_SERVERS, order=order).server[emb]
    write_rows_csv(out_dir / f"per_server_{PLOT_SERVERS}.csv", servers)
    model = "BERT-large" if config == bert.BERT_LARGE else "BERT (small variant)"
    plot_per_server(out_dir / f"per_server_{PLOT_SERVERS}.png", servers, emb_server, model)

    # The layout at 8 servers: where the embedding sits.
    plan8 = plan_fusion(shapes, buffer_bytes=BUFFER_BYTES, num_shards=NODES[0], order=order)
    layout, spans = [], 0
    for b, segs in enumerate(plan8.segments):
        in_emb = sum(s.stop - s.start for s in segs if s.leaf == emb) * item
        spans += bool(in_emb)
        layout.append((b, len(segs), f"{plan8.buffer_sizes[b] * item / 1024:.1f}",
                       f"{in_emb / 1024:.1f}" if in_emb else "-"))  # fmt: skip

    # Our last gradients against the paper's Table II (the last 10 ms of its backward pass).
    tail = order[-len(PAPER_TABLE2) :]
    table2 = []
    for leaf, (index, length) in zip(tail, PAPER_TABLE2):
        n = math.prod(leaves[leaf].shape)
        table2.append((names[leaf], n, f"{n * item / 1024:g}", index, length,
                       f"{length * 2 / 1024:g}",
                       "yes" if PAPER_NAMES[index] == names[leaf] else "no"))  # fmt: skip
    table2_match = all(r[-1] == "yes" for r in table2)
    tail_kb = sum(math.prod(leaves[i].shape) for i in tail) * item / 1024
    paper_tail_kb = sum(n for _, n in PAPER_TABLE2) * 2 / 1024

    a = np.array([r["atomic_bytes"] for r in servers]) / MIB
    f_ = np.array([r["bfb_bytes"] + r["bfb_padding_bytes"] for r in servers]) / MIB
    busiest_note = (
        ", the embedding's" if int(a.argmax()) == emb_server else f" (embedding: {emb_server})"
    )
    bfb_range = f"{f_.max():.2f}" if f_.min() == f_.max() else f"{f_.min():.2f} to {f_.max():.2f}"
    auto = [(n, auto_buffer_bytes(total_bytes, n, item)) for n in NODES]
    auto8 = plan_fusion(shapes, num_shards=NODES[0], order=order)
    ours_vocab, hidden = leaves[emb].shape
    pad_elems = math.prod(PAPER_EMBEDDING) - ours_vocab * hidden

    heads = ("ours", "elements", "KB", "paper index", "paper length", "paper KB", "same")
    table2_md = markdown_table(heads, table2, "lrrrrrl")
    layout_md = markdown_table(("buffer", "variables", "KB", "KB of embedding"), layout, "rrrr")
    t3 = markdown_table(
        ("nodes (= servers)", "atomic MiB (ours)", "paper", "BFB MiB (ours)", "paper"),
        [(r["nodes"], f"{r['atomic_mb']:.2f}", PAPER_ATOMIC_MB.get(r["nodes"], "-"),
          f"{r['bfb_mb']:.2f}", PAPER_BFB_MB) for r in rows],
        "rrrrr",
    )  # fmt: skip
    return f"""# Herring Table III on {model} shapes

Thangakrishnan et al., "Herring: Rethinking the Parameter Server at Scale for the Cloud"
(SC 2020), section III. Computed from shapes with `shoal.comms.fusion.plan_fusion` and
`atomic_placement`, gradients in the production order `gradient_order` finds in the
backward pass of the masked-LM + next-sentence loss of `shoal.experiments.tasks.bert`
(nothing allocated): `jax.eval_shape` of the parameters took {t_shapes:.1f} s, tracing the
gradient's jaxpr {t_order:.1f} s.

## The model

| | ours | paper |
|---|---:|---:|
| trainable variables | {len(leaves)} | {PAPER_VARIABLES} |
| parameters | {n_params:,} | "340 million" |
| fp16 gradient bytes | {total_bytes:,} ({total_bytes / MIB:.1f} MiB) | "680 MB" |
| word embedding | {ours_vocab} x {hidden} = {ours_vocab * hidden:,} ({emb_bytes / 1024:g} KB) \
| {PAPER_EMBEDDING[0]} x {PAPER_EMBEDDING[1]} = {math.prod(PAPER_EMBEDDING):,} \
({math.prod(PAPER_EMBEDDING) * 2 / 1024:g} KB) |

The variable count {"matches" if len(leaves) == PAPER_VARIABLES else "does NOT match"} the
paper's {PAPER_VARIABLES}: 5 embedding variables (word, position, token type, LayerNorm
scale and bias), 16 per layer x {config.num_layers}, pooler 2, masked-LM head 5 (transform
dense 2, LayerNorm 2, output bias; the decoder is the word embedding), next-sentence
classifier 2. "340 million" and "680 MB" (= 340M x 2 bytes) are the paper's round numbers.

## Table III: MiB the server holding the embedding receives while a buffer with it is reduced

{t3}

Atomic: {NODES[0]}..{NODES[-1]} workers each send that server the whole embedding gradient
(N x {emb_bytes:,} B). BFB ({PAPER_BUFFER_KB} KB = {BUFFER_BYTES:,} B buffers, one shard per
server): that server receives its 1/N shard from each of the N workers, N x (buffer / N) =
one buffer whatever N. The embedding lies in {spans} buffer(s) here (below); the column is
the largest of them.

Why ours differ from the paper's:
- The paper's MB are MiB: 8 x 61056 KB / 1024 = 477.0, and 86684 KB / 1024 = 84.65 (printed
  84.6).
- Its embedding has {math.prod(PAPER_EMBEDDING):,} = {PAPER_EMBEDDING[0]} x {hidden} elements
  (NVIDIA pads the vocabulary to a multiple of 8), ours {ours_vocab} x {hidden}:
  {pad_elems:,} elements = {pad_elems * 2 / 1024:g} KB fewer, so our atomic column is
  N x 12 KB / 1024 below the paper's (476.91 vs 477 at 8 nodes, 3815.25 vs 3816 at 64).
- BFB is identical: both are one {PAPER_BUFFER_KB} KB buffer, independent of the model and N.

## Where the embedding sits in the buffers (8 servers, {PAPER_BUFFER_KB} KB)

Buffers fill from the first gradient produced (the masked-LM head), so the last buffer holds
the remainder ({plan8.buffer_sizes[-1] * item / 1024:.1f} KB) and the embedding, produced
last, lies in the last {spans}:

{layout_md}

The paper's 86684 KB is exactly the sum of its Table II, the 18 gradients of the last 10 ms
of the backward pass ({paper_tail_kb:g} KB): its example buffer is those 18 whole
variables, ending with the embedding. Our last 18 gradients are the same variables in the
same order: {"yes" if table2_match else "NO"} ({tail_kb:g} KB: {paper_tail_kb - tail_kb:g} KB
less, the vocabulary padding):

{table2_md}

## Per-server load per iteration ({PLOT_SERVERS} workers, {PLOT_SERVERS} servers)

`per_server_{PLOT_SERVERS}.csv` / `per_server_{PLOT_SERVERS}.png`: bytes each server receives
from all workers per iteration (it sends as much back). Atomic (round-robin in production
order, {len(leaves)} variables on {PLOT_SERVERS} servers): max {a.max():.0f} MiB on server
{int(a.argmax())}{busiest_note}, mean {a.mean():.0f}, min {a.min():.0f} MiB, max / mean =
{a.max() / a.mean():.1f}. BFB: {bfb_range} MiB on every server (the last buffer's tail padding is
{sum(r["bfb_padding_bytes"] for r in servers):,} B in all). The iteration waits for the
busiest server, which under atomic placement receives {a.max() / f_.max():.1f}x what every
BFB server does; on top of that comes the imbalance in time of Fig. 1: the embedding's
server can only start when the backward pass ends, and since every layer has 16 variables
and 16 divides {PLOT_SERVERS}, the large kernels of every layer land on the same few
servers.

## Our automatic buffer size

`plan_fusion(..., buffer_bytes=None)` (`auto_buffer_bytes`: about 1/{BUFFERS_PER_STEP} of the
model, at least 64 KiB per shard, whole elements per shard) gives {model} on {NODES[0]} servers
{auto8.buffer_bytes[0]:,} B = {auto8.buffer_bytes[0] / 1024:.1f} KB ({auto8.num_buffers}
buffers) against the paper's {PAPER_BUFFER_KB} KB (which our layout cuts into
{plan8.num_buffers} buffers).
By N: {", ".join(f"{n}: {b / 1024:.1f} KB" for n, b in auto)}.
"""


DESCRIPTION = "Herring (SC 2020) Table III: atomic placement vs balanced fusion buffers"


def get_config() -> Analysis:
    return Analysis(name="herring_table3", run=analyse, description=DESCRIPTION)
