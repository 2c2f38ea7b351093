"""The codecs of `shoal.comms`: `Compressor` and its subclasses, and `tree_mean`.

``base`` holds the `Compressor` interface (a codec, its error feedback, bytes and
pattern), `Float32` and `tree_mean`; ``onebit``, ``quantized`` and ``topk`` the codecs.
`shoal.comms` exports the classes too: it is their public place.
"""

from shoal.comms.codecs.base import Compressor, Float32, tree_mean
from shoal.comms.codecs.onebit import OneBit
from shoal.comms.codecs.quantized import Quantized
from shoal.comms.codecs.topk import TopK

__all__ = ["Compressor", "Float32", "OneBit", "Quantized", "TopK", "tree_mean"]
