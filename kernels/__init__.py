"""shoal.kernels: compression kernels (Pallas on GPU, a jnp reference everywhere)."""

from shoal.kernels.gtc import gtc_pack, gtc_unpack
from shoal.kernels.sign import sign_pack, sign_unpack

__all__ = [
    "gtc_pack",
    "gtc_unpack",
    "sign_pack",
    "sign_unpack",
]
