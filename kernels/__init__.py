"""shoal.kernels: compression kernels (Pallas on GPU, a jnp reference everywhere)."""

from shoal.kernels.gtc import gtc_pack, gtc_unpack

__all__ = ["gtc_pack", "gtc_unpack"]
