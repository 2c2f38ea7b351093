"""Quickstart: S-SGD, GTC, BMUF, two-tier BMUF_GTC, LAMB and 1-bit LAMB, Herring's BFB,
KungFu's partial gradient exchange (PGX), peer model averaging, SMA and the adaptive
policy on 8 simulated workers, about 2.5 minutes on 2 CPU cores.

Run with ``shoal-run experiments/configs/quickstart.py --workers 8`` (``make run``).
BMUF syncs every 10 steps; BMUF_GTC runs GTC inside 2 groups of 4 workers and BMUF
across them. ``steps`` is a multiple of ``block_size``, so the last step is a BMUF step.
Every algorithm but two trains with momentum SGD (each one's ``local``); LAMB and 1-bit
LAMB run LAMB at their ``learning_rate``, so ``lamb`` (LAMB on a dense all-reduce)
is the baseline that 1-bit LAMB is compared with. 1-bit LAMB all-reduces densely for its
first 30 steps (15%), then sends its momentum as signs: about 5.6x fewer bytes than LAMB
over the run. BFB reduces the gradient through balanced fusion buffers (here one buffer:
the model is small); PGX averages one of two bins of leaves per step; peer averaging
exchanges models with one peer per step; SMA pulls every model a tenth of the way to the
mean; adaptive switches from S-SGD to PGX once the gradient noise scale passes a
threshold. DiLoCo (inner AdamW, outer Nesterov SGD every 10 steps), MuLoCo (the same
with Muon inside), Streaming DiLoCo (4 fragments syncing in turn) and SparseLoCo (a
2-bit top-k of 1.6% of a decaying error-feedback accumulator, untuned), eager overlapped
DiLoCo (the last round's mean with this worker's fresh share, DiLoCo's outer step),
DES-LOC (local Adam, the params averaged every 10 steps, the moments every 30 and 60),
SPARTA (local AdamW, 0.5% of each leaf averaged after every step), NoLoCo (DiLoCo's
rounds averaged with one random peer, untuned), top-k with error
feedback (1% of each chunk of 64), PowerSGD (rank 4) and DeMo (sign of the mean
decoupled momentum, SGD at ``demo.learning_rate``)
complete the table.
"""

from shoal.experiments.config import Config


def get_config() -> Config:
    return Config(
        name="quickstart",
        algorithms=(
            "ssgd",
            "gtc",
            "bmuf",
            "bmuf_gtc",
            "lamb",
            "onebit_lamb",
            "bfb_allreduce",
            "partial_exchange",
            "peer_averaging",
            "sma",
            "adaptive",
            "diloco",
            "muloco",
            "streaming_diloco",
            "sparseloco",
            "overlapped_diloco",
            "desloc",
            "sparta",
            "noloco",
            "topk",
            "powersgd",
            "demo",
        ),  # fmt: skip
        workers=8,
        steps=200,
        batch_size=32,
        eval_every=25,
        # The table's projected step time: 128 workers, 8 per node, 25 Gbps between nodes.
        project_workers=128,
        # Each algorithm's own hyper-parameters (the rest are its module's defaults: the
        # local optimizer is momentum SGD at 0.05 and 0.9, BMUF's block 10 steps).
        params={
            "bmuf_gtc": {"group_size": 4},
            "lamb": {"learning_rate": 0.02},
            "onebit_lamb": {"learning_rate": 0.02, "freeze_fraction": 0.15},
            # The MLP's largest leaf is 59% of its gradient: PGX needs bins at least that big.
            "partial_exchange": {"fraction": 0.6},
            # adaptive: S-SGD until the noise scale's median over 10 steps passes 250 (after
            # step 100; it grows from ~150 to ~300 over this run), then PGX at 0.6.
            "adaptive": {"fraction": 0.6, "threshold": 250.0, "after": 100},
            "demo": {"learning_rate": 0.01},
        },
    )
