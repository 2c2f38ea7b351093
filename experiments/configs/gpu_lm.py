"""The GPU check's language-model run (``benchmarks/gpu_check.py``, stage ``lm``): S-SGD
with AdamW against DiLoCo and Streaming DiLoCo at about 25M parameters, 8 simulated
workers, the same tokens for every entry.

Run with ``shoal-run experiments/configs/gpu_lm.py`` (sized for one H100 or H200: about
a minute a method there; on 2 CPU cores each step takes seconds). Task
(`shoal.experiments.tasks.lm`): next-byte prediction on the running Python's standard
library source, an 8-block causal transformer of width 512 (25.5M parameters), 256-byte
windows, 8 per worker and step: 16,384 tokens a step over the 8 workers, 3.9M in the run.

Entries, each with the DiLoCo paper's inner recipe scaled to this run (AdamW, a linear
warm-up over 5% of the steps, then cosine decay to 0, gradients clipped at global norm
1.0):

- ``ssgd_adamw``: the gradients all-reduced every step, then AdamW;
- ``diloco``: H = 40 inner steps per round (6 rounds), outer Nesterov SGD (0.7, 0.9);
- ``streaming_diloco``: the same H, 4 fragments syncing in turn (one every 10 steps),
  overlap 0, the outer gradient in fp4 (`shoal.comms.Quantized`, blocks of 128 with error
  feedback), as the Streaming DiLoCo paper sends it.

The loss is nats per byte (a byte is a token here); the bytes are each worker's exact
sent bytes. When the scalable language model of the issue "Does it reproduce?" lands,
its study takes this run's place in the GPU check.
"""

from shoal.experiments.config import Config

STEPS = 240
H = 40
ADAMW = {
    "learning_rate": 1e-3,
    "schedule": {"kind": "cosine", "warmup_steps": STEPS // 20},
    "clip": 1.0,
}


def get_config() -> Config:
    return Config(
        name="gpu_lm",
        algorithms=("ssgd_adamw", "diloco", "streaming_diloco"),
        task="lm",
        workers=8,
        steps=STEPS,  # a multiple of H: each run ends on a full outer step
        batch_size=8,
        seq_len=256,
        train_size=16384,  # windows; one pass is 16384 / (8 x 8) = 256 steps
        test_size=512,
        eval_every=40,
        lm_width=512,
        lm_layers=8,
        lm_heads=8,
        params={
            "ssgd_adamw": {"adamw": ADAMW},
            "diloco": {"sync_every": H, "inner": {"adamw": ADAMW}},
            "streaming_diloco": {
                "sync_every": H,
                "exchange": {"codec": "fp4"},
                "inner": {"adamw": ADAMW},
            },
        },
    )
