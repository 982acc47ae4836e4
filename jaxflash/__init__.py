"""jaxflash: FlashAttention-2 for JAX, as XLA FFI custom calls with a fused backward pass."""
from . import reference
from .attention import attention

__all__ = ["attention", "reference"]
__version__ = "0.1.0"
