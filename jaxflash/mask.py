"""`Mask`: the one description of which keys a query sees, built by every entry point and passed down whole."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class Mask:
    """Which keys each query sees: the causal diagonal, a window around it, segment ids and lengths.

    Attributes:
      causal: query ``i`` sees key ``j`` iff ``j <= c``, ``c`` the diagonal of query ``i`` (see ``bottom_right``).
      window: ``(left, right)``: query ``i`` sees key ``j`` iff ``c - left <= j <= c + right``; ``None`` (or -1)
        leaves a side unbounded. Combines with ``causal`` (``causal=True`` is ``window=(None, 0)``).
      q_segment_ids, kv_segment_ids: int ``[..., Sq]`` and ``[..., Sk]``, given together: a query sees a key only
        when their ids are equal (packed documents).
      q_lengths, kv_lengths: int ``[...]``: keys at or past ``kv_lengths`` are invisible; query rows at or past
        ``q_lengths`` see nothing (output 0).
      bottom_right: where the diagonal lies: ``c = i + (Sk - Sq)`` (``True``: FlashAttention and
        `jaxflash.attention`; with lengths per sequence, ``c = i + kv_lengths - q_lengths``) or ``c = i``
        (``False``: jax.nn and Flax). The two agree when ``Sq == Sk`` and no lengths are given.
      offset: a static int added to the diagonal: ``c = i + (Sk - Sq) + offset`` (or ``i + offset``). For a
        block of queries that starts ``offset`` positions after its keys start (a chunk of a longer sequence
        against the whole cache, or a ring step); 0 by default.

    A pytree: the arrays are leaves, ``causal``, ``window``, ``bottom_right`` and ``offset`` static, so a mask
    crosses ``jit``, ``vmap`` and Flax's lifted transforms.
    """
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    q_lengths: Any = None
    kv_lengths: Any = None
    bottom_right: bool = True
    offset: int = 0

    def __post_init__(self):
        if isinstance(self.window, list):  # static pytree data must be hashable
            object.__setattr__(self, "window", tuple(self.window))

    def sides(self) -> tuple[int, int]:
        """The window as ``(left, right)`` with -1 for an unbounded side; ``causal`` caps ``right`` at 0."""
        left, right = (-1, -1) if self.window is None else (-1 if w is None else int(w) for w in self.window)
        if self.causal:
            right = 0 if right < 0 else min(right, 0)
        return left, right

    def diagonal(self, sq: int, sk: int) -> int:
        """Key index of query 0's diagonal."""
        return (sk - sq if self.bottom_right else 0) + self.offset


def register(cls):
    """Register a `Mask` class (or subclass) as a pytree: arrays as leaves, the rest static."""
    jax.tree_util.register_dataclass(cls, data_fields=["q_segment_ids", "kv_segment_ids", "q_lengths", "kv_lengths"],
                                     meta_fields=["causal", "window", "bottom_right", "offset"])
    return cls


register(Mask)
