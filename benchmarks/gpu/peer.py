"""Stage 6, shoal's simulated DiLoCo against drjax on the device: `sim_vs_jax_peer`'s
systems (shoal with every leaf per worker; with its rank-uniform state held once, as
``shoal-run`` runs it; that with the H = 10 inner steps of a round in one scan; that with
its local steps one worker after another, `shoal.optim.helpers.take_turns`; drjax in
MaxText's layout; the JAX floor, one worker's AdamW step times N) on the byte-level LM at
25.5M parameters (width 512, 8 blocks) and `sim_scale`'s MLP at 25M, x 8 and 16 workers.

Per system: seconds per round (median of interleaved rounds), XLA's memory and the
state carried, per worker, and the largest difference of its global model from shoal's
after one round. The issue's targets (read on the CPU): shoal at most drjax's time and
memory per worker, and at most 1.05x the floor.

drjax is not on the GPU machine: it travels as its wheel (pure Python), fetched here with
``python3 -m pip download --no-deps -d .whl drjax==0.2.1`` and carried (``.whl``); this
stage imports it from there. Without it the stage runs the other systems and says so.
"""

from __future__ import annotations

import gc
import logging
import sys

CELLS_GPU = [("lm", 8), ("mlp", 8), ("lm", 16), ("mlp", 16)]
CELLS_REHEARSE = [("mlp", 2), ("lm", 2)]
SIZES_GPU = {"lm": dict(width=512, layers=8, heads=8), "mlp": "25M"}
SIZES_REHEARSE = {"lm": dict(width=32, layers=1, heads=2), "mlp": "16"}
H = 10
REPS_GPU, REPS_REHEARSE = 3, 1
HELD_SCANNED = "shoal, held once, scanned"

COLUMNS = [
    ("cell", "model x N"),
    ("system", "system"),
    ("s_round", "s/round"),
    ("vs_held_scanned", "/ held+scanned"),
    ("mb_per_worker", "XLA MB/worker"),
    ("state_mb", "state MB/worker"),
    ("diff", "max diff to shoal"),
]


def import_drjax(root) -> bool:
    """Whether drjax imports, from the machine or from a carried wheel in ``.whl``."""
    try:
        import drjax  # noqa: F401

        return True
    except ImportError:
        pass
    for wheel in sorted((root / ".whl").glob("drjax-*.whl")):
        sys.path.append(str(wheel))  # a pure-Python wheel imports as a zip
        try:
            import drjax  # noqa: F401, F811

            return True
        except ImportError:
            sys.path.remove(str(wheel))
    return False


def model_of(kind: str, sizes):
    import sim_scale
    import sim_vs_jax_peer as peer

    if kind == "lm":
        return peer.ByteLM(**sizes["lm"])
    return peer.MLP(sim_scale.parse_size(sizes["mlp"]))


def run(record, ctx) -> bool:
    import jax
    import sim_vs_jax_peer as peer

    record.set(device=ctx.device_name())
    logging.getLogger("absl").setLevel(logging.ERROR)  # drjax: no mesh for simulated workers
    has_drjax = import_drjax(ctx.root)
    if not has_drjax:
        record.note(
            "drjax is not installed here: fetch its wheel with `python3 -m pip download "
            "--no-deps -d .whl drjax==0.2.1` and carry .whl; the other systems ran"
        )
    sizes = SIZES_REHEARSE if ctx.rehearse else SIZES_GPU
    reps = REPS_REHEARSE if ctx.rehearse else REPS_GPU
    ok = True
    for kind, n in CELLS_REHEARSE if ctx.rehearse else CELLS_GPU:
        if record.left() < 20:
            record.note(f"{kind} x {n} and after: not run, out of time")
            break
        model = model_of(kind, sizes)
        cell = f"{model.label} x {n}"
        try:
            out = peer.measure(model, n, H, reps, drjax=has_drjax)
        except Exception as err:  # out of memory: a row, then the next cell
            ok = False
            record.row(cell=cell, system="(all)", error=f"{type(err).__name__}: {str(err)[:300]}")
            continue
        finally:
            gc.collect()
            jax.clear_caches()
        base = out["seconds"][HELD_SCANNED]
        for system, seconds in out["seconds"].items():
            record.row(
                cell=cell,
                system=system,
                s_round=round(seconds, 4),
                vs_held_scanned=round(seconds / base, 2),
                mb_per_worker=round(out["memory"][system] / 1e6, 1),
                state_mb=round(out["state"][system] / 1e6, 1),
                diff=f"{out['agree'][system]:.1e}" if system in out["agree"] else "",
            )
    return ok and has_drjax


def summary(rows) -> str:
    cells = {}
    for r in rows:
        cells.setdefault(r["cell"], {})[r.get("system")] = r
    said = []
    for cell, systems in cells.items():
        ours, drjax = systems.get(HELD_SCANNED), systems.get("drjax")
        if not ours or not drjax or ours.get("s_round") is None:
            said.append(f"{cell}: no comparison")
            continue
        faster = drjax["s_round"] / ours["s_round"]
        leaner = ours["mb_per_worker"] <= drjax["mb_per_worker"]
        said.append(f"{cell}: drjax/shoal {faster:.2f}x time, memory {'<=' if leaner else '>'}")
    return "; ".join(said) or "no rows"
