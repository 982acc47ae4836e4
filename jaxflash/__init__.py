"""jaxflash: FlashAttention-2 for JAX, as XLA FFI custom calls with a fused backward pass."""
from . import reference
from .attention import attention
from .combine import combine
from .dropout import dropout_mask
from .mask import Mask
from .nn import dot_product_attention
from .paged import append_kv, paged_attention
from .ring import ring_attention, unzigzag, zigzag

# jaxflash.flax (Flax modules) is a submodule imported on demand, so that importing jaxflash never imports flax.
__all__ = ["Mask", "append_kv", "attention", "combine", "dot_product_attention", "dropout_mask", "paged_attention",
           "reference", "ring_attention", "unzigzag", "zigzag"]
__version__ = "0.1.0"
