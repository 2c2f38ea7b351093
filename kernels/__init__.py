"""shoal.kernels: compression kernels (Pallas on GPU, a jnp reference everywhere)."""

from shoal.kernels.gtc import gtc_pack, gtc_pack_parts, gtc_unpack
from shoal.kernels.quant import dequantize, quantize
from shoal.kernels.sign import sign_pack, sign_unpack

__all__ = [
    "dequantize",
    "gtc_pack",
    "gtc_pack_parts",
    "gtc_unpack",
    "quantize",
    "sign_pack",
    "sign_unpack",
]
