"""The acoustic-modelling stand-in: an LSTM frame classifier on HMM sequences
(`shoal.experiments.tasks.acoustic`), S-SGD, GTC, BMUF and BMUF_GTC on 8 simulated workers
for 2 epochs (about a minute on 2 CPU cores).

Run with ``shoal-run experiments/configs/acoustic.py``. The paper-style tables over
worker counts, block sizes and group sizes come from ``acoustic_study.py``, which
shares these settings.

Learning rates follow the linear scaling rule from ``LR``, the rate of one worker
alone: the local step is ``LR`` times the number of workers whose gradients one update
averages, ``N`` for S-SGD and GTC, ``group_size`` for BMUF_GTC, 1 for BMUF (its block
momentum, eq. 5, already scales the block's progress by ``N``): each method's
``local.learning_rate``, in ``params`` for the run and in brackets per entry.
"""

from shoal.experiments.config import Config

LR = 0.02
WORKERS = 8
GROUP_SIZE = 4
# GTC's tau and buffer (GTC and BMUF_GTC): buffers hold 2.5% of the parameters; about 1.6%
# pass tau here.
GTC = {"threshold": 0.05, "capacity": 0.025}


def entries(workers: int, block_size: int = 10, group_size: int = GROUP_SIZE) -> dict[str, str]:
    """``{method: algorithm entry}`` of the four methods on ``workers`` workers."""
    return {
        "S-SGD": f"ssgd[local.learning_rate={LR * workers:g}]",
        "GTC": f"gtc[local.learning_rate={LR * workers:g}]",
        "BMUF": f"bmuf[block_size={block_size}]",
        "BMUF_GTC": f"bmuf_gtc[block_size={block_size};group_size={group_size};"
        f"local.learning_rate={LR * group_size:g}]",
    }


def get_config() -> Config:
    return Config(
        name="acoustic",
        algorithms=tuple(entries(WORKERS).values()),
        task="hmm",
        workers=WORKERS,
        steps=1280,  # 2 epochs: 2 * train_size / (workers * batch_size)
        batch_size=2,  # sequences of seq_len frames per worker and step
        eval_every=320,
        # 64 states in 40 dimensions, weak emissions: one frame alone is labelled wrong
        # about 57% of the time, the true HMM's forward filter about 14%.
        num_classes=64,
        num_features=40,
        class_sep=0.35,
        seq_len=32,
        hmm_self_loop=0.8,
        hmm_successors=4,
        train_size=10240,
        test_size=1024,
        hidden=(64,),
        # Each method's own hyper-parameters: the local optimizer (momentum SGD, 0.9) at LR
        # for all four (the entries' brackets scale it); BMUF's block is 10 steps.
        params={
            "ssgd": {"local": {"learning_rate": LR}},
            "gtc": {**GTC, "local": {"learning_rate": LR}},
            "bmuf": {"local": {"learning_rate": LR}},
            "bmuf_gtc": {**GTC, "group_size": GROUP_SIZE, "local": {"learning_rate": LR}},
        },
    )
