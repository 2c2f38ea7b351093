"""``compression_pareto.py``'s entries on the byte-level LM (`shoal.experiments.tasks.lm`: a
2-block causal transformer of width 64 on the Python standard library's source), 8
simulated workers, about 12 minutes a seed on 2 CPU cores (`docs/experiments/studies.md`
runs it tuned, over 3 seeds: ``--seeds 0,1,2 --sweep learning_rate=x0.3,x1,x3``, 47
minutes).

Run with ``shoal-run experiments/configs/compression_pareto_lm.py``.
"""

from shoal.experiments.config import Config
from shoal.experiments.configs.compression_pareto import COMMON, params


def get_config() -> Config:
    return Config(
        name="compression_pareto_lm",
        task="lm",
        steps=300,
        batch_size=4,
        seq_len=128,
        train_size=20000,
        test_size=512,
        lm_width=64,
        lm_layers=2,
        lm_heads=4,
        params=params(learning_rate=0.1),
        **COMMON,
    )
