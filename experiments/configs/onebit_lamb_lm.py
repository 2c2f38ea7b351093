"""LAMB versus 1-bit LAMB (Li et al. 2021) on a byte-level transformer language model,
8 simulated workers, about 4 minutes on 2 CPU cores.

Run with ``shoal-run experiments/configs/onebit_lamb_lm.py``. Task (`shoal.experiments.tasks.lm`):
next-byte prediction on the running Python's standard library source, read from the
installed ``*.py`` files (every tenth file held out for validation; nothing is
downloaded), by a 2-block causal transformer of width 64 with tied byte embeddings
(about 120k parameters). Both algorithms start from the same model and see the same
batches; 1-bit LAMB's warm-up (dense all-reduce) is the first 15% of the steps, as in
the paper's BERT runs (a warm-up fraction w of 10-20%), so the formula of its section 5
predicts 1 / (w + (1 - w) / 32) = 5.1x less traffic than a float32 all-reduce. The
summary's "LAMB vs 1-bit LAMB" section compares that with the measured bytes and plots
the validation loss against the samples seen.
"""

from shoal.experiments.config import Config

LAMB = {"learning_rate": 0.02, "lr_warmup": 0.05, "lr_decay": "cosine"}


def get_config() -> Config:
    return Config(
        name="onebit_lamb_lm",
        algorithms=("lamb", "onebit_lamb"),
        task="lm",
        workers=8,
        steps=300,
        batch_size=4,  # windows of seq_len bytes per worker and step
        seq_len=128,
        train_size=20000,  # evenly spaced windows over the training files
        test_size=512,
        eval_every=25,
        lm_width=64,
        lm_layers=2,
        lm_heads=4,
        # Both: LAMB at a peak of 0.02 after a linear warm-up over 5% of the steps, then a
        # cosine decay; 1-bit LAMB freezes at 15% of the steps (its default).
        params={"lamb": LAMB, "onebit_lamb": {**LAMB, "freeze_fraction": 0.15}},
    )
