"""Ring attention on simulated CPU devices: `jaxflash.ring_attention` inside `shard_map`, for both layouts, against
`jaxflash.attention` on the whole, unsharded arrays (output, LSE and the gradients of q, k and v), plus its errors
and `zigzag` / `unzigzag`."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from conftest import stable_seed

import jaxflash


def _mesh(n):
    return Mesh(np.array(jax.devices()[:n]), ("sp",))


def _inputs(seed, b, sq, sk, hq, hk, d):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s).astype(np.float32)
              for s in ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, hq, d))]
    ids = (np.sort(rng.integers(0, 3, (b, sq)), axis=1).astype(np.int32),
           np.sort(rng.integers(0, 3, (b, sk)), axis=1).astype(np.int32))
    return [jnp.asarray(a) for a in arrays], [jnp.asarray(i) for i in ids]


def _ring(n, layout, q, k, v, qs, ks, do, kw):
    """(out, lse, dq, dk, dv) of ring attention over n devices, in the global (unpermuted) order."""
    seg = kw.pop("segments", False)

    def local(q, k, v, qs, ks):
        extra = dict(q_segment_ids=qs, kv_segment_ids=ks) if seg else {}
        return jaxflash.ring_attention(q, k, v, axis_name="sp", layout=layout, return_lse=True, **extra, **kw)

    seq, ids = P(None, "sp"), P(None, "sp")
    f = jax.shard_map(local, mesh=_mesh(n), in_specs=(seq, seq, seq, ids, ids), out_specs=(seq, P(None, None, "sp")))
    if layout == "zigzag":
        q, k, v, do = (jaxflash.zigzag(x, n) for x in (q, k, v, do))
        qs, ks = (jaxflash.zigzag(x, n, axis=-1) for x in (qs, ks))

    def loss(q, k, v):
        out, lse = f(q, k, v, qs, ks)
        return jnp.sum(out * do) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    if layout == "zigzag":
        out, *grads = (jaxflash.unzigzag(x, n) for x in (out, *grads))
        lse = jaxflash.unzigzag(lse, n, axis=-1)
    return out, lse, *grads


def _whole(q, k, v, qs, ks, do, kw):
    seg = kw.pop("segments", False)
    extra = dict(q_segment_ids=qs, kv_segment_ids=ks) if seg else {}

    def loss(q, k, v):
        out, lse = jaxflash.attention(q, k, v, return_lse=True, **extra, **kw)
        return jnp.sum(out * do) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

    (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, lse, *grads


CASES = {
    "full": {},
    "causal": dict(causal=True),
    "window": dict(window=(9, 3)),
    "window-left-causal": dict(causal=True, window=(20, None)),
    "window-right": dict(window=(None, 13)),
    "segments-causal": dict(segments=True, causal=True),
    "lengths": dict(lengths=True),
    "lengths-causal": dict(causal=True, lengths=True),
    "lengths-window": dict(window=(6, 2), lengths=True),
    "softcap": dict(softcap=4.0, causal=True),
    "scale-deterministic": dict(scale=0.3, deterministic=True),
    "dropout": dict(dropout_rate=0.3, dropout_key=jax.random.key(7)),
    "dropout-causal-segments": dict(dropout_rate=0.2, dropout_key=jax.random.key(8), causal=True, segments=True),
}


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("case, n, sq, sk",
                         [(c, 4, 48, 128 if "dropout" in c else 64) for c in CASES]  # a draw: 16 keys
                         + [("full", 2, 40, 40), ("causal", 2, 40, 40)])
def test_ring_matches_whole_sequence(layout, case, n, sq, sk):
    (q, k, v, do), (qs, ks) = _inputs(stable_seed("ring", layout, case, n, sq, sk), 2, sq, sk, 4, 2, 8)
    kw = dict(CASES[case])
    if kw.pop("lengths", False):
        kw.update(q_lengths=jnp.asarray([sq, sq - 7], jnp.int32), kv_lengths=jnp.asarray([sk - 11, sk], jnp.int32))
    got = _ring(n, layout, q, k, v, qs, ks, do, dict(kw))
    want = _whole(q, k, v, qs, ks, do, dict(kw))
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        g, w = np.asarray(g), np.asarray(w)
        np.testing.assert_array_equal(np.isinf(g), np.isinf(w), err_msg=f"{name}: infinities differ")
        fin = np.isfinite(w)
        np.testing.assert_allclose(g[fin], w[fin], atol=2e-5, rtol=2e-5, err_msg=name)


def test_ring_on_eight_devices_causal_zigzag():
    (q, k, v, do), (qs, ks) = _inputs(stable_seed("ring8"), 1, 64, 64, 2, 1, 8)
    got = _ring(8, "zigzag", q, k, v, qs, ks, do, dict(causal=True))
    want = _whole(q, k, v, qs, ks, do, dict(causal=True))
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5, err_msg=name)


def test_ring_skips_invisible_blocks(monkeypatch):
    """A (query, key) block pair that no query can see gets no kernel: count the kernel calls traced (one per
    distinct mask a step needs; a skipped pair's branch has none)."""
    from jaxflash import ring

    (q, k, v, _), _ = _inputs(0, 1, 32, 32, 2, 2, 8)
    masks = []

    def counting_attend(*args, **kwargs):
        masks.append(args[3])
        return attend(*args, **kwargs)

    attend = ring.attend
    monkeypatch.setattr(ring, "attend", counting_attend)

    def traced(kw):
        masks.clear()
        f = jax.shard_map(lambda q, k, v: jaxflash.ring_attention(q, k, v, axis_name="sp", **kw), mesh=_mesh(4),
                          in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))
        jax.jit(f).lower(q, k, v)
        return [(m.causal, m.window, m.offset) for m in masks]

    # Causal: step 0 the diagonal block on every shard; steps 1-3 one unmasked branch (earlier shards' keys) and
    # a skipped one (later shards' keys).
    assert traced(dict(causal=True)) == [(True, (-1, 0), 0)] + [(False, None, 0)] * 3
    # A window of 3 keys to the left: the diagonal block, then the previous shard's block (offset 8 keys), then
    # nothing at all.
    assert traced(dict(window=(3, 0))) == [(False, (3, 0), 0), (False, (3, 0), 8)]


def test_next_slice_is_sent_before_the_current_kernel():
    """Communication can overlap computation: in program order (the lowered module XLA schedules from) the K and
    V of step s + 1 are sent around the ring before step s's kernel is called, and nothing makes the kernel wait
    for them. Whether the transfer then runs under the kernel is up to XLA's scheduler on the GPU (asynchronous
    collective-permutes); the CPU runs them in turn."""
    (q, k, v, _), _ = _inputs(0, 1, 64, 64, 2, 2, 32)
    f = jax.shard_map(lambda q, k, v: jaxflash.ring_attention(q, k, v, axis_name="sp"), mesh=_mesh(4),
                      in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))
    text = jax.jit(f).lower(q, k, v).as_text()
    bodies = dict(re.findall(r"func\.func (?:public|private) @(\w+)\((.*?)(?=\n\s*func\.func|\Z)", text, re.S))
    kernel_fns = {name for name, body in bodies.items() if "@jaxflash_fwd" in body}
    while True:  # functions that call one that runs the kernel run it too
        more = {n for n, b in bodies.items() if any(f"func.call @{k}(" in b for k in kernel_fns)} - kernel_fns
        if not more:
            break
        kernel_fns |= more
    sent, kernels = 0, []  # per kernel call in main: collective-permutes issued before it
    for line in bodies["main"].splitlines():
        if "collective_permute" in line:
            sent += 1
        elif any(f"func.call @{k}(" in line for k in kernel_fns) or "@jaxflash_fwd" in line:
            kernels.append(sent)
    assert len(kernels) == 4, kernels
    for step, before in enumerate(kernels[:-1]):
        assert before >= 2 * (step + 1), kernels  # K and V of the next step already on their way


def test_zigzag_round_trip_and_order():
    x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
    z = jaxflash.zigzag(x, 4, axis=1)
    chunks = np.asarray(z).reshape(2, 8, 2, 3)[0, :, :, 0] // 3 // 2  # chunk index of each row pair
    assert chunks.tolist() == [[0, 0], [7, 7], [1, 1], [6, 6], [2, 2], [5, 5], [3, 3], [4, 4]]
    np.testing.assert_array_equal(jaxflash.unzigzag(z, 4, axis=1), x)


def test_ring_errors():
    q = jnp.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match=r"jaxflash.ring_attention: axis_name 'sp' is not bound"):
        jaxflash.ring_attention(q, q, q, axis_name="sp")
    with pytest.raises(ValueError, match=r"jaxflash.ring_attention: layout must be one of"):
        jaxflash.ring_attention(q, q, q, axis_name="sp", layout="ring")
    six = jnp.zeros((1, 24, 2, 8))  # 6 keys a shard
    f = jax.shard_map(lambda q: jaxflash.ring_attention(q, q, q, axis_name="sp", dropout_rate=0.1,
                                                        dropout_key=jax.random.key(0)),
                      mesh=_mesh(4), in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    with pytest.raises(ValueError, match=r"jaxflash.ring_attention: with dropout, a shard's keys must be a multiple "
                                         r"of 16 \(the width of one dropout draw\); got 6"):
        jax.jit(f)(six)
    f = jax.shard_map(lambda q: jaxflash.ring_attention(q, q, q, axis_name="sp", dropout_rate=0.1),
                      mesh=_mesh(4), in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    with pytest.raises(ValueError, match=r"jaxflash.ring_attention: dropout_rate=0.1 needs a dropout_key"):
        jax.jit(f)(six)
    odd = jnp.zeros((1, 12, 2, 8))
    f = jax.shard_map(lambda q: jaxflash.ring_attention(q, q, q, axis_name="sp", layout="zigzag"), mesh=_mesh(4),
                      in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    with pytest.raises(ValueError, match=r"layout='zigzag' splits each shard's queries into two chunks; its local "
                                         r"length must be even, got 3"):
        jax.jit(f)(odd)
    with pytest.raises(ValueError, match=r"jaxflash.zigzag: the length of axis 1 \(12\) must be a multiple of "
                                         r"2 \* num_shards = 8"):
        jaxflash.zigzag(odd, 4, axis=1)
    with pytest.raises(ValueError, match=r"jaxflash.ring_attention: window must be a pair"):
        jaxflash.ring_attention(q, q, q, axis_name="sp", window=(1, 2, 3))
