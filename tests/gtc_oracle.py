"""NumPy oracle of Strom's threshold encoding in shoal's 1 + 31-bit word format, shared by
the kernel tests and the property tests."""

import numpy as np

SIGN = 1 << 31


def pack_oracle(values, tau, capacity, offset=0):
    """NumPy GTC encoder: the first `capacity` qualifying elements in cyclic order."""
    v = np.asarray(values, np.float32)
    tau = np.float32(tau)
    n = v.size
    with np.errstate(invalid="ignore"):
        qualifies = np.abs(v) > tau
    cyclic = np.concatenate([np.arange(offset, n), np.arange(offset)])
    sent = np.sort(cyclic[qualifies[cyclic]][:capacity])
    negative = v[sent] < 0
    words = np.zeros(capacity, np.int64)
    words[: sent.size] = sent | np.where(negative, SIGN, 0)
    remainder = v.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        remainder[sent] = np.where(negative, v[sent] + tau, v[sent] - tau)
    return words.astype(np.uint32).view(np.int32), sent.size, remainder


def unpack_oracle(words, count, tau, size):
    """NumPy GTC decoder: tau * (number of +tau words - number of -tau words)."""
    words = np.asarray(words).reshape(-1, np.shape(words)[-1])
    net = np.zeros(size, np.int64)
    for w, c in zip(words, np.asarray(count).reshape(-1), strict=True):
        w = w[:c].view(np.uint32).astype(np.int64)
        index = w & (SIGN - 1)
        keep = index < size
        np.add.at(net, index[keep], np.where(w[keep] & SIGN, -1, 1))
    return net.astype(np.float32) * np.float32(tau)
