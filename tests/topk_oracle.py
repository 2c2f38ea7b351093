"""NumPy oracle of top-k sparsification (shared by the compressor and optimizer tests)."""

import numpy as np


def np_topk(v, fraction, chunk, bits):
    """One worker's encode-decode of v (float32[n_pad]) in NumPy: top-k per chunk by
    magnitude (lowest index first on ties), values optionally quantized to a sign and
    2^(bits-1) magnitudes up to the chunk's largest."""
    blocks = v.reshape(-1, chunk)
    k = max(1, int(np.ceil(round(fraction * chunk, 9))))
    out = np.zeros_like(blocks)
    for b, row in enumerate(blocks):
        idx = np.argsort(-np.abs(row), kind="stable")[:k]
        vals = row[idx]
        if bits is not None:
            levels = 2 ** (bits - 1)
            s = np.abs(vals).max()
            j = np.clip(np.rint(np.abs(vals) * levels / (s if s > 0 else 1)) - 1, 0, levels - 1)
            magnitude = (s * (j + 1) / np.float32(levels)).astype(np.float32)
            vals = np.where(vals < 0, -magnitude, magnitude)
        out[b, idx] = vals
    return out.reshape(-1).astype(np.float32)
