"""Flax adapters for jaxflash attention (needs ``pip install flax``; ``import jaxflash`` alone never imports flax).

- `FlashMultiHeadAttention` (flax.linen) and `FlashMultiHeadAttentionNNX` (flax.nnx): multi-head attention with
  the parameters of Flax's ``MultiHeadDotProductAttention`` / ``nnx.MultiHeadAttention`` (same names and shapes,
  so checkpoints swap both ways), the jaxflash kernels in the middle, and masks given as structure (causal,
  window, segment ids, lengths) rather than as an ``[..., H, Sq, Sk]`` array.
- `attention_fn`: a drop-in ``attention_fn=`` for Flax's own modules; `Mask` (`jaxflash.Mask` aligned top-left)
  describes the masks it honours.

Conventions here are Flax's and jax.nn's: the causal diagonal and windows are aligned top-left (query ``i``'s
diagonal is key ``i``), which is `jaxflash.attention`'s bottom-right alignment whenever ``Sq == Sk``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx

from . import mask as core
from .attention import attend

__all__ = ["FlashMultiHeadAttention", "FlashMultiHeadAttentionNNX", "Mask", "attention_fn"]

_MASK_HINT = ("express it as causal=/window= and the q_segment_ids/kv_segment_ids/q_lengths/kv_lengths keywords "
              "(FlashMultiHeadAttention) or as mask=jaxflash.flax.Mask(...) (attention_fn)")


@core.register
@dataclasses.dataclass(frozen=True)
class Mask(core.Mask):
    """`jaxflash.Mask` aligned top-left by default, as Flax aligns masks: the masks `attention_fn` honours,
    passed where Flax passes a mask array (``mask=`` of the module call).

    Attributes:
      causal: query ``i`` sees key ``j`` iff ``j <= i`` (top-left, as ``nn.make_causal_mask``).
      window: ``(left, right)``: query ``i`` sees key ``j`` iff ``i - left <= j <= i + right``; ``None`` (or -1)
        leaves a side unbounded.
      q_segment_ids, kv_segment_ids: int ``[batch..., Sq]`` and ``[batch..., Sk]``, given together: a query sees
        a key only when their ids are equal (packed documents).
      q_lengths, kv_lengths: int ``[batch...]``: keys at or past ``kv_lengths`` are invisible; query rows at or
        past ``q_lengths`` return 0.
      bottom_right: ``False``; ``True`` aligns the diagonal as `jaxflash.attention` does.

    A pytree: the arrays are leaves, ``causal``, ``window`` and ``bottom_right`` static, so it crosses ``jit`` and
    Flax's lifted transforms.
    """
    bottom_right: bool = False


def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True, dropout_rng=None,
                 dropout_rate: float = 0.0, deterministic: bool = False, dtype=None, precision=None, module=None,
                 is_causal: bool = False, force_fp32_for_softmax: bool = False, qk_attn_weights_einsum=None,
                 attn_weights_value_einsum=None):
    """``flax.linen.dot_product_attention``'s signature on the jaxflash kernels, for ``attention_fn=`` of
    ``flax.linen.MultiHeadDotProductAttention`` and ``flax.nnx.MultiHeadAttention``.

    ``query`` ``[batch..., Sq, H, D]``, ``key``/``value`` ``[batch..., Sk, Hkv, D]`` (GQA when ``Hkv < H``);
    returns ``[batch..., Sq, H, D]``. What it cannot honour raises instead of being dropped:

    - ``mask``: ``None`` or a `Mask` (causal, window, segment ids, lengths; a `jaxflash.Mask` keeps its
      bottom-right alignment, this module's `Mask` aligns top-left as Flax does). A mask *array* raises
      ``NotImplementedError``: the kernels never build the ``[..., H, Sq, Sk]`` matrix. Flax's modules pass
      ``mask=`` through unchanged, so ``module.apply(params, x, mask=jaxflash.flax.Mask(causal=True))`` replaces
      ``mask=nn.make_causal_mask(...)``. ``is_causal=True`` (nnx) adds the causal mask.
    - ``bias``: must be None (``NotImplementedError``).
    - Dropout (``dropout_rate > 0`` and not ``deterministic``) runs inside the kernel with one independent draw
      per (batch, head, query, key) element from ``dropout_rng``, the rule of `jaxflash.dropout_mask`. Flax's
      default ``broadcast_dropout=True`` shares one draw across batch and heads, which the kernel cannot do:
      with dropout active it raises ``NotImplementedError``; construct the module with
      ``broadcast_dropout=False``. Without dropout the flag is irrelevant and accepted.
    - ``module`` (``sow_weights=True``) and the AQT einsum overrides raise ``NotImplementedError``: there are no
      attention weights to sow or to multiply with a custom einsum.
    - ``dtype`` casts query, key and value (default: their promoted dtype). ``precision`` and
      ``force_fp32_for_softmax`` are accepted and have no effect: the kernels multiply in the input dtype and
      always run the softmax and accumulate in float32.

    Rows that see no key (e.g. past ``q_lengths``) return 0, where Flax's softmax over ``finfo.min`` logits
    returns the mean of ``value``.
    """
    name = "jaxflash.flax.attention_fn"
    if bias is not None:
        raise NotImplementedError(f"{name}: an attention bias is not supported; got bias of shape "
                                  f"{jnp.shape(bias)}")
    if mask is not None and not isinstance(mask, core.Mask):
        raise NotImplementedError(f"{name}: a mask array cannot be honoured (the kernels never build the "
                                  f"[..., H, Sq, Sk] matrix); got mask of shape {jnp.shape(mask)}. Pass "
                                  f"mask=jaxflash.flax.Mask(causal=..., window=..., q_segment_ids=..., "
                                  f"kv_segment_ids=..., q_lengths=..., kv_lengths=...) or use "
                                  f"jaxflash.flax.FlashMultiHeadAttention")
    if module is not None:
        raise NotImplementedError(f"{name}: sow_weights=True is not supported: the attention weights are never "
                                  f"materialised")
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
        raise NotImplementedError(f"{name}: custom attention einsums (qk_attn_weights_einsum, "
                                  f"attn_weights_value_einsum) are not supported; the kernels do both products")
    mask = mask or Mask()
    if is_causal:
        mask = dataclasses.replace(mask, causal=True)
    dropping = not deterministic and dropout_rate > 0
    if dropping and broadcast_dropout:
        raise NotImplementedError(f"{name}: broadcast_dropout=True (one dropout mask shared by the batch and heads) "
                                  f"cannot be honoured by the kernel's per-element dropout; construct the module "
                                  f"with broadcast_dropout=False (or set deterministic=True or dropout_rate=0)")
    if dropping and dropout_rng is None:
        raise ValueError(f"{name}: dropout_rate={dropout_rate} with deterministic=False needs a dropout_rng; got None")
    dtype = dtype or jnp.result_type(query, key, value)
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    return attend(query, key, value, mask, dropout_rate=dropout_rate if dropping else 0.0,
                  dropout_key=dropout_rng if dropping else None, name=name)


def _no_mask_array(name, mask):
    if mask is not None:
        raise NotImplementedError(f"{name}: a mask array cannot be honoured (the kernels never build the "
                                  f"[..., H, Sq, Sk] matrix); got mask of shape {jnp.shape(mask)}. {_MASK_HINT}")


def _check_heads(name, num_heads, num_kv_heads, qkv_features):
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{name}: num_heads must be a positive multiple of num_kv_heads; got num_heads="
                         f"{num_heads}, num_kv_heads={num_kv_heads}")
    if qkv_features % num_heads:
        raise ValueError(f"{name}: qkv_features must be divisible by num_heads; got qkv_features={qkv_features}, "
                         f"num_heads={num_heads}")
    return qkv_features // num_heads


class FlashMultiHeadAttention(nn.Module):
    """Multi-head attention on the jaxflash kernels, for flax.linen.

    Parameters are those of ``flax.linen.MultiHeadDotProductAttention`` with the same attributes: ``query``,
    ``key``, ``value`` (``DenseGeneral`` to ``[heads, head_dim]``), ``out``, and ``query_ln``/``key_ln`` with
    ``normalize_qk``; with ``num_kv_heads < num_heads`` (grouped-query attention, which Flax's linen module
    lacks) ``key`` and ``value`` project to ``num_kv_heads`` heads. Heads are split as ``[batch..., S, H, D]``.

    Attributes (beyond Flax's ``num_heads, dtype, param_dtype, qkv_features, out_features, dropout_rate,
    deterministic, precision, kernel_init, out_kernel_init, bias_init, out_bias_init, use_bias, normalize_qk``):
      num_kv_heads: key/value heads; ``None`` is ``num_heads``; must divide it.
      causal: query ``i`` sees key ``j`` iff ``j <= i`` (top-left, as ``nn.make_causal_mask``).
      window: ``(left, right)``: query ``i`` sees keys ``i - left ... i + right``; ``None`` leaves a side open.
      softcap: ``c``: scores become ``c * tanh(s / c)`` before the softmax.
      backend: `jaxflash.attention`'s ``backend`` (``None``: the kernel of the platform).

    Dropout drops attention probabilities inside the kernel, one draw per (batch, head, query, key) element
    (`jaxflash.dropout_mask`'s rule), from the ``'dropout'`` rng stream or ``dropout_rng``; there is no
    ``broadcast_dropout``. ``deterministic=True`` (attribute or call argument; the call wins, as in Flax)
    turns it off. No autoregressive cache (``decode``) and no ``sow_weights``.
    """
    num_heads: int
    num_kv_heads: int | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    qkv_features: int | None = None
    out_features: int | None = None
    dropout_rate: float = 0.0
    deterministic: bool | None = None
    precision: Any = None
    kernel_init: Callable = nn.linear.default_kernel_init
    out_kernel_init: Callable | None = None
    bias_init: Callable = nn.initializers.zeros_init()
    out_bias_init: Callable | None = None
    use_bias: bool = True
    normalize_qk: bool = False
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    backend: str | None = None

    @nn.compact
    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None, q_segment_ids=None,
                 kv_segment_ids=None, q_lengths=None, kv_lengths=None, deterministic: bool | None = None,
                 dropout_rng=None):
        """inputs ``[batch..., S, features]`` (``inputs_k`` defaults to ``inputs_q``, ``inputs_v`` to
        ``inputs_k``); segment ids ``[batch..., S]`` and lengths ``[batch...]`` as in `Mask`; returns
        ``[batch..., Sq, out_features]``. ``mask`` exists only to reject Flax-style mask arrays."""
        name = "jaxflash.flax.FlashMultiHeadAttention"
        _no_mask_array(name, mask)
        inputs_k = inputs_q if inputs_k is None else inputs_k
        inputs_v = inputs_k if inputs_v is None else inputs_v
        qkv_features = self.qkv_features or inputs_q.shape[-1]
        kv_heads = self.num_kv_heads or self.num_heads
        head_dim = _check_heads(name, self.num_heads, kv_heads, qkv_features)

        def dense(heads, name):
            return nn.DenseGeneral(features=(heads, head_dim), axis=-1, dtype=self.dtype,
                                   param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                                   bias_init=self.bias_init, use_bias=self.use_bias, precision=self.precision,
                                   name=name)

        query = dense(self.num_heads, "query")(inputs_q)
        key = dense(kv_heads, "key")(inputs_k)
        value = dense(kv_heads, "value")(inputs_v)
        if self.normalize_qk:  # as Flax: LayerNorm over head_dim, no bias
            query = nn.LayerNorm(use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                                 name="query_ln")(query)
            key = nn.LayerNorm(use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, name="key_ln")(key)

        rate = 0.0
        if self.dropout_rate > 0:  # as Flax: `deterministic` is needed only when there is dropout
            if not nn.merge_param("deterministic", self.deterministic, deterministic):
                rate = self.dropout_rate
                dropout_rng = self.make_rng("dropout") if dropout_rng is None else dropout_rng
        mask = Mask(self.causal, self.window, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths)
        x = attend(query, key, value, mask, softcap=self.softcap, dropout_rate=rate,
                   dropout_key=dropout_rng if rate else None, backend=self.backend, name=name)
        return nn.DenseGeneral(features=self.out_features or inputs_q.shape[-1], axis=(-2, -1),
                               kernel_init=self.out_kernel_init or self.kernel_init,
                               bias_init=self.out_bias_init or self.bias_init, use_bias=self.use_bias,
                               dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision,
                               name="out")(x)


class FlashMultiHeadAttentionNNX(nnx.Module):
    """Multi-head attention on the jaxflash kernels, for flax.nnx.

    Constructor arguments and parameters (``query``, ``key``, ``value``, ``out`` ``LinearGeneral``s, and
    ``query_ln``/``key_ln`` with ``normalize_qk``) are those of ``flax.nnx.MultiHeadAttention``, GQA included
    (``num_kv_heads``), so ``nnx.update(flash, nnx.state(flax_module, nnx.Param))`` swaps weights either way.
    Added: ``causal``, ``window``, ``softcap``, ``backend`` as in `FlashMultiHeadAttention`; absent:
    ``broadcast_dropout`` (dropout is per element), ``attention_fn``, ``decode``.

    Dropout draws its key from ``rngs`` given to the call, else from the ``dropout`` stream forked from the
    constructor's ``rngs`` (``keep_rngs=True``), as Flax does.
    """

    def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
                 out_features: int | None = None, num_kv_heads: int | None = None,
                 in_kv_features: int | None = None, *, dtype=None, param_dtype=jnp.float32,
                 dropout_rate: float = 0.0, deterministic: bool | None = None, precision=None,
                 kernel_init: Callable = nnx.nn.linear.default_kernel_init, out_kernel_init: Callable | None = None,
                 bias_init: Callable = nnx.initializers.zeros_init(), out_bias_init: Callable | None = None,
                 use_bias: bool = True, normalize_qk: bool = False, causal: bool = False, window=None,
                 softcap: float | None = None, backend: str | None = None, rngs: nnx.Rngs, keep_rngs: bool = True):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.in_features = in_features
        self.qkv_features = qkv_features or in_features
        self.out_features = out_features or in_features
        self.head_dim = _check_heads("jaxflash.flax.FlashMultiHeadAttentionNNX", num_heads, self.num_kv_heads,
                                     self.qkv_features)
        self.dropout_rate = dropout_rate
        self.deterministic = deterministic
        self.normalize_qk = normalize_qk
        self.causal, self.softcap, self.backend = causal, softcap, backend
        self.window = None if window is None else tuple(window)  # nnx would wrap a list as a pytree

        def linear(in_features, heads):
            return nnx.LinearGeneral(in_features, (heads, self.head_dim), dtype=dtype, param_dtype=param_dtype,
                                     kernel_init=kernel_init, bias_init=bias_init, use_bias=use_bias,
                                     precision=precision, rngs=rngs)

        kv_in = in_kv_features or in_features
        self.query = linear(in_features, num_heads)
        self.key = linear(kv_in, self.num_kv_heads)
        self.value = linear(kv_in, self.num_kv_heads)
        if normalize_qk:
            self.query_ln = nnx.LayerNorm(self.head_dim, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                          rngs=rngs)
            self.key_ln = nnx.LayerNorm(self.head_dim, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                        rngs=rngs)
        else:
            self.query_ln = self.key_ln = None
        self.out = nnx.LinearGeneral((num_heads, self.head_dim), self.out_features, axis=(-2, -1),
                                     kernel_init=out_kernel_init or kernel_init,
                                     bias_init=out_bias_init or bias_init, use_bias=use_bias, dtype=dtype,
                                     param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.rngs = rngs.dropout.fork() if keep_rngs and dropout_rate > 0 else None

    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None, q_segment_ids=None,
                 kv_segment_ids=None, q_lengths=None, kv_lengths=None, deterministic: bool | None = None,
                 rngs: nnx.Rngs | nnx.RngStream | None = None):
        """As `FlashMultiHeadAttention.__call__`; ``deterministic`` here wins over the constructor's."""
        name = "jaxflash.flax.FlashMultiHeadAttentionNNX"
        _no_mask_array(name, mask)
        inputs_k = inputs_q if inputs_k is None else inputs_k
        inputs_v = inputs_k if inputs_v is None else inputs_v
        query, key, value = self.query(inputs_q), self.key(inputs_k), self.value(inputs_v)
        if self.normalize_qk:
            query, key = self.query_ln(query), self.key_ln(key)

        rate, dropout_key = 0.0, None
        if self.dropout_rate > 0:
            deterministic = self.deterministic if deterministic is None else deterministic
            if deterministic is None:
                raise ValueError(f"{name}: dropout_rate={self.dropout_rate} needs deterministic= (constructor or "
                                 f"call); got None in both")
            if not deterministic:
                stream = rngs.dropout if isinstance(rngs, nnx.Rngs) else rngs if rngs is not None else self.rngs
                if stream is None:
                    raise ValueError(f"{name}: dropout needs rngs= in the call when built with keep_rngs=False")
                rate, dropout_key = self.dropout_rate, stream()
        mask = Mask(self.causal, self.window, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths)
        x = attend(query, key, value, mask, softcap=self.softcap, dropout_rate=rate, dropout_key=dropout_key,
                   backend=self.backend, name=name)
        return self.out(x)
