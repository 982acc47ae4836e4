"""jaxflash: FlashAttention-2 for JAX, as XLA FFI custom calls with a fused backward pass."""
from . import reference
from .attention import attention
from .dropout import dropout_mask

__all__ = ["attention", "dropout_mask", "reference"]
__version__ = "0.1.0"
