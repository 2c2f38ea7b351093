"""Herring's Table III on BERT-large shapes (Thangakrishnan et al., SC 2020, section III):
the model's shapes against a hand count, the production order of its gradients against
the paper's Table II, and the analysis config's outputs against closed forms."""

from __future__ import annotations

import csv
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from shoal.experiments.config import ConfigError
from shoal.experiments.configs import herring_table3 as h3
from shoal.experiments.runner.analysis import Analysis, run_analysis
from shoal.experiments.runner.cli import main
from shoal.experiments.tasks import bert

CONFIG = Path(__file__).resolve().parents[1] / "experiments" / "configs" / "herring_table3.py"

# BERT-large, by hand from the architecture.
V, H, L, F, P, T = 30522, 1024, 24, 4096, 512, 2  # F: intermediate (feed-forward) width
EMBEDDINGS = V * H + P * H + T * H + 2 * H  # word, position, token type, LayerNorm
LAYER = 4 * (H * H + H) + 2 * H + (H * F + F) + (F * H + H) + 2 * H  # q,k,v,out; LN; MLP; LN
POOLER = H * H + H
MLM = (H * H + H) + 2 * H + V  # transform dense, LayerNorm, output bias (decoder tied)
NSP = H * 2 + 2
TOTAL = EMBEDDINGS + L * LAYER + POOLER + MLM + NSP
VARIABLES = 5 + 16 * L + 2 + 5 + 2

SMALL = bert.BertConfig(
    vocab_size=100, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256,
    max_positions=64,
)  # fmt: skip


def test_bert_large_shapes():
    shapes = bert.param_shapes(bert.BERT_LARGE)
    leaves = jax.tree.leaves(shapes)
    assert TOTAL == 336_226_108  # "340 million" in the paper
    assert bert.num_parameters(shapes) == TOTAL
    assert len(leaves) == VARIABLES == h3.PAPER_VARIABLES == 398
    assert shapes["word_embeddings"]["embedding"].shape == (V, H)
    assert all(x.dtype == jnp.float16 for x in leaves)
    assert not any("decoder" in n for n in bert.leaf_names(shapes))  # tied to the embedding


def _group(name: str) -> int:
    """Where a variable's gradient must come in the backward pass: heads (computed last
    in the forward pass), then the layers from the top, then the embeddings, and the word
    embedding (tied to the masked-LM decoder, so finished by its input lookup) last."""
    if name.startswith(("mlm_", "nsp_", "pooler")):
        return 0
    if name.startswith("layer_"):
        return 1 + (SMALL.num_layers - 1 - int(name.split("/")[0].removeprefix("layer_")))
    if name == h3.EMBEDDING:
        return SMALL.num_layers + 2
    return SMALL.num_layers + 1


def test_small_bert_gradient_order():
    shapes = bert.param_shapes(SMALL)
    names = bert.leaf_names(shapes)
    order = bert.production_order(SMALL, batch_size=2, seq_len=16, max_predictions=3)
    assert sorted(order) == list(range(len(names)))
    produced = [names[i] for i in order]
    groups = [_group(n) for n in produced]
    assert groups == sorted(groups), produced
    assert set(groups) == set(range(SMALL.num_layers + 3))
    assert produced[-1] == h3.EMBEDDING
    # The first layer and the embeddings come out in the order of the paper's Table II
    # (the last 18 gradients of its BERT-large backward pass).
    assert produced[-18:] == [h3.PAPER_NAMES[i] for i, _ in h3.PAPER_TABLE2]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("herring") / "table3"
    assert main([str(CONFIG), "--out", str(out)]) == 0
    return out


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_table3_values(run_dir):
    rows = _rows(run_dir / "table3.csv")
    assert [int(r["nodes"]) for r in rows] == [8, 16, 32, 64]
    assert list(rows[0]) == ["nodes", "atomic_mb", "bfb_mb"]
    for r in rows:
        n = int(r["nodes"])
        # Atomic: every worker sends the whole fp16 embedding to its one server.
        assert float(r["atomic_mb"]) == pytest.approx(n * V * H * 2 / 2**20, abs=1e-6)
        # BFB: 1/n of one 86684 KB buffer from each of n workers.
        assert float(r["bfb_mb"]) == pytest.approx(86684 / 1024, abs=1e-6)


def test_per_server_sums(run_dir):
    rows = _rows(run_dir / "per_server_64.csv")
    assert [int(r["server"]) for r in rows] == list(range(64))
    col = lambda k: [int(r[k]) for r in rows]
    # Each of the 64 servers receives its part of every fp16 gradient from 64 workers.
    assert sum(col("atomic_bytes")) == TOTAL * 2 * 64
    assert sum(col("bfb_bytes")) == TOTAL * 2 * 64
    # BFB is balanced: shards of equal size (the padding only tops up the last shard).
    sent = [b + p for b, p in zip(col("bfb_bytes"), col("bfb_padding_bytes"))]
    assert len(set(sent)) == 1
    assert sum(col("bfb_padding_bytes")) < 64 * 64 * 2
    # Atomic: the embedding's server is the busiest, by more than the whole embedding.
    atomic = col("atomic_bytes")
    assert max(atomic) >= 64 * V * H * 2 > sent[0]


def test_outputs_and_summary(run_dir):
    names = {p.name for p in run_dir.iterdir()}
    assert {"table3.csv", "summary.md", "per_server_64.png", "per_server_64.csv"} <= names
    png = (run_dir / "per_server_64.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 200_000
    summary = (run_dir / "summary.md").read_text()
    assert "| trainable variables | 398 | 398 |" in summary
    assert "| 64 | 3815.25 | 3816 | 84.65 | 84.6 |" in summary
    assert "same order: yes" in summary


@pytest.mark.parametrize("extra", [["--set", "name=x"], ["--workers", "4"]])
def test_cli_refuses_settings(tmp_path, capsys, extra):
    assert main([str(CONFIG), "--out", str(tmp_path / "x"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shoal-run: error: an analysis") and "\n" not in err
    assert not (tmp_path / "x").exists()


def test_analysis_contract(tmp_path):
    def run(out: Path) -> str:
        (out / "a.txt").write_text("1")
        return "# hi\n"

    assert run_analysis(Analysis("a", run), tmp_path / "o") == "# hi\n"
    assert (tmp_path / "o" / "summary.md").read_text() == "# hi\n"
    with pytest.raises(ConfigError, match="name"):
        Analysis("a/b", run)
    with pytest.raises(ConfigError, match="callable"):
        Analysis("a", "not a function")
