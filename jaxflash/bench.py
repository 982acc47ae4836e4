"""`python -m jaxflash.bench`: check, then time, jaxflash against standard attention and its peers.

Suites (`--suite`):
  sweep    the benchmark grid: D in {64, 128, 256}, S in {512 .. 16k}, causal off/on, fwd and fwd+bwd, at
           16k tokens and model width 2048 (B = 16384 / S, H = 2048 / D), plus a GQA shape (Hq=64, Hkv=8, B=2,
           S=8k) and the long-sequence memory case (B=1, H=16, S=128k fwd / 64k fwd+bwd, jaxflash only).
           On the CPU: jaxflash against XLA's attention (jax.nn.dot_product_attention, implementation="xla"),
           float32, B=1, H=4, D in {64, 128}, S in {256, 1024, 2048, 4096}, causal off/on, fwd and fwd+bwd;
           each jaxflash row beside its target: >= 1.5x XLA's speed at S >= 1024, >= 1.0x at S = 256.
  targets  the shapes with a performance target on Hopper (D=128 at S=1k, 4k, 16k and causal 16k; D=64 and 256 at
           16k), the target beside each jaxflash number (GPU only).
  masks    D=128, S=16k: causal, window=(1024, 0), 16 packed documents of 1k tokens, softcap=30, each against
           the same implementation without a mask (fwd and fwd+bwd).
  dropout  D=128, S=16k, dropout_rate=0.1 against 0 (fwd and fwd+bwd).
  seed     D=128, N in {1k, 8k}: speedup and memory saved over standard attention (`xla`).
  decode   one new token (or 4: a speculative draft) against a long KV cache, Hq=32, Hkv=8, D=128: B=1 Sk=128k,
           B=8 Sk=32k, B=64 Sk=4k, B=8 Sq=4 Sk=32k (CPU: Hq=8, Hkv=2, B=1 Sk=16k, B=8 Sk=4k, B=8 Sq=4 Sk=4k);
           jaxflash.attention on the contiguous cache, jaxflash.paged_attention on 16- and 64-token pages
           (shuffled), cuDNN and XLA through jax.nn. Reports GB/s of K + V + Q + O and of K + V alone, the paged
           rows against the contiguous one and, on a GPU, the targets (K + V read at 3.5 to 4 TB/s, paged within
           10 % of contiguous). `--seqlens` replaces the cache lengths (Sq 1 and 4 each, B = `--batch` or 1).
  ring     ring attention over every device (two or more): B=1, H=16, D=128, S=128k (GPU; 1k on the CPU), causal,
           `ring-zigzag` and `ring-contiguous` against `jaxflash` on one device, fwd and fwd+bwd; peak MB is per
           device. The zigzag rows are timed on zigzag-ordered inputs (the permutation is the caller's, once).
Implementations: jaxflash (`jaxflash-det`: deterministic=True, on request); standard attention (`reference`:
jaxflash.reference, materialising jnp; `xla`: jax.nn.dot_product_attention's XLA path); cuDNN through jax.nn;
flash_attn_jax, flash_attn3_jax (FlashAttention-3) and Pallas Triton when they import (GPU). A mask, dropout or
GQA that an implementation cannot express leaves it out of that row; a feature that raises NotImplementedError
shows as "n/a (not implemented)".

Method. Before timing, every implementation is checked against a float64 NumPy oracle on a smaller case of the same
configuration (B=1, S=300 (384 for Pallas, which needs S % 128 == 0), 2 heads or one GQA group, the same head dim,
dtype, mask and dropout): max |impl - oracle| / max |oracle| over o (and dq, dk, dv for fwd+bwd) must stay under
2e-2 (1e-3 in float32); one that fails is not timed and the command exits 1. Timing on a GPU: CUPTI device time
(jax.experimental.mosaic.gpu.profiler.measure, every kernel of one call summed), `--reps` calls on each of two
input sets larger than L2, median (without CUPTI: wall time of 2 x reps back-to-back calls and one final
block_until_ready); on the CPU: wall time of synchronised calls, interleaved: `--reps` rounds of one call of
each implementation (the first of each round rotating), the median per implementation, so load from other jobs on
a shared machine hits every implementation alike. One fwd+bwd call is a jitted
forward plus jax.vjp (dq, dk, dv). FLOPs: 4*B*H*Sq*Sk*D times the visible fraction of the score matrix (1/2 for
causal, FlashAttention's convention); fwd+bwd 3.5x that. Peak memory: XLA's buffer assignment of the compiled call
(arguments + outputs + temporaries - aliased), on every platform: a device's peak memory_stats cannot be reset
between runs.

`--out DIR` writes results.csv, results.json and tflops.png (TFLOP/s against S per implementation).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash

TOKENS, WIDTH = 16384, 2048
SUITES = ("sweep", "targets", "masks", "dropout", "seed", "ring", "decode")
PASSES = ("fwd", "fwdbwd")


# --- what runs --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """One attention configuration, its mask features scaled with S so a small check case keeps their shape."""
    label: str
    causal: bool = False
    window: bool = False  # window=(S // 16, 0): (1024, 0) at S = 16k
    docs: int = 0  # this many packed documents of S / docs tokens each (segment ids)
    softcap: float | None = None
    dropout: float = 0.0

    def kwargs(self, b, s):
        """Keywords of jaxflash.attention at batch b, length s."""
        kw = {"causal": self.causal}
        if self.window:
            kw["window"] = (s // 16, 0)
        if self.docs:
            ids = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32) * self.docs // s, (b, s))
            kw.update(q_segment_ids=ids, kv_segment_ids=ids)
        if self.softcap:
            kw["softcap"] = self.softcap
        if self.dropout:
            kw.update(dropout_rate=self.dropout, dropout_key=jax.random.key(7))
        return kw

    def density(self, s):
        """Visible fraction of the S x S scores: the FLOPs that count."""
        if self.causal:
            return 0.5
        if self.window:
            w = s // 16
            return (s * (w + 1) - w * (w + 1) / 2) / s**2
        if self.docs:
            sizes = np.bincount(np.arange(s) * self.docs // s)
            return float(np.sum(sizes.astype(np.float64) ** 2)) / s**2
        return 1.0


FULL, CAUSAL = Case("full"), Case("causal", causal=True)
MASKS = (FULL, CAUSAL, Case("window", window=True), Case("docs", docs=16), Case("softcap", softcap=30.0))
DROPOUT = Case("dropout", dropout=0.1)


def jax_nn_mask(kw):
    """jax.nn's keywords for the mask of `kw`, in the form its cuDNN path computes right: a window with a right side
    of 0 goes as is_causal=True with local_window_size=(w, 0) (the same mask); as is_causal=False it silently
    returns a different result there (benchmarks/RESULTS.md, "Peers' findings")."""
    window = kw.get("window")
    causal = kw["causal"] or (window is not None and window[1] == 0)
    return dict(is_causal=causal, local_window_size=window)


def _jax_nn(implementation):
    def attn(q, k, v, kw):
        return jax.nn.dot_product_attention(q, k, v, **jax_nn_mask(kw), implementation=implementation)
    return attn


def _ring(layout):
    """jaxflash.ring_attention over every device, the sequence axis split across them (inputs placed so by
    `place`); with zigzag the inputs and outputs are in zigzag order."""
    def attn(q, k, v, kw):
        f = jax.shard_map(lambda q, k, v: jaxflash.ring_attention(q, k, v, axis_name="sp", layout=layout, **kw),
                          mesh=_seq_mesh(), in_specs=(_SEQ,) * 3, out_specs=_SEQ)
        return f(q, k, v)
    return attn


_SEQ = jax.sharding.PartitionSpec(None, "sp")


def _seq_mesh():
    return jax.sharding.Mesh(np.array(jax.devices()), ("sp",))


RING = {"ring-zigzag": "zigzag", "ring-contiguous": "contiguous"}


def place(impl, arrays):
    """The inputs as `impl` takes them: split along the sequence over every device for the ring."""
    if impl not in RING:
        return arrays
    sharding = jax.sharding.NamedSharding(_seq_mesh(), _SEQ)
    return [jax.device_put(x, sharding) for x in arrays]


# name -> (attention(q, k, v, kw), the keywords beyond `causal` it can express; "gqa": fewer key/value heads)
IMPLS = {
    "jaxflash": (lambda q, k, v, kw: jaxflash.attention(q, k, v, **kw), None),
    "jaxflash-det": (lambda q, k, v, kw: jaxflash.attention(q, k, v, deterministic=True, **kw), None),
    "reference": (lambda q, k, v, kw: jaxflash.reference.attention(q, k, v, **kw), None),
    "xla": (_jax_nn("xla"), {"window", "gqa"}),
    "cudnn": (_jax_nn("cudnn"), {"window", "gqa"}),
    **{name: (_ring(layout), None) for name, layout in RING.items()},
}


def _add_peers():
    """Peers that import on this machine (GPU only), under their package names."""
    try:
        from flash_attn_jax import flash_mha
        IMPLS["flash_attn_jax"] = (
            lambda q, k, v, kw: flash_mha(q, k, v, is_causal=kw["causal"], window_size=kw.get("window", (-1, -1))),
            {"window", "gqa"})
    except Exception:  # noqa: BLE001  (absent, or built for another jax)
        pass
    try:  # FlashAttention-3 (Hopper), the same call as flash_attn_jax's
        from flash_attn3_jax import flash_mha as flash_mha3
        IMPLS["flash_attn3_jax"] = (
            lambda q, k, v, kw: flash_mha3(q, k, v, is_causal=kw["causal"], window_size=kw.get("window", (-1, -1))),
            {"window", "gqa"})
    except Exception:  # noqa: BLE001
        pass
    try:
        from jax.experimental.pallas.ops.gpu.attention import mha
        IMPLS["pallas"] = (lambda q, k, v, kw: mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5,
                                                   causal=kw["causal"]), set())
    except Exception:  # noqa: BLE001
        pass


CHECK_LEN = {"pallas": 384, "ring-zigzag": 512, "ring-contiguous": 512}  # Pallas' mha needs S % 128 == 0; the
# ring, S % (2 x devices) == 0 (and keys per chunk % 16 for dropout: 512 serves up to 16 devices)


def supports(impl, kw):
    extra = IMPLS[impl][1]
    return extra is None or set(kw) - {"causal"} <= extra


def make_fn(impl, kw, pass_):
    attn = IMPLS[impl][0]
    if pass_ == "fwd":
        return jax.jit(lambda q, k, v: attn(q, k, v, kw))

    def fwd_bwd(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, kw), q, k, v)
        return (o, *vjp(do))

    return jax.jit(fwd_bwd)


def inputs(seed, b, s, hq, hkv, d, dtype, pass_):
    """Random normal q, k, v (and dO for fwd+bwd), never zeros."""
    key = jax.random.key(seed)
    shapes = [(b, s, hq, d), (b, s, hkv, d), (b, s, hkv, d)] + [(b, s, hq, d)] * (pass_ == "fwdbwd")
    return [jax.random.normal(jax.random.fold_in(key, i), shape, dtype) for i, shape in enumerate(shapes)]


def flops(b, h, s, d, density, pass_):
    return 4 * b * h * s * s * d * density * (3.5 if pass_ == "fwdbwd" else 1.0)


# --- correctness ------------------------------------------------------------------------------------------

def oracle(q, k, v, do, *, mask, keep=None, rate=0.0, softcap=None):
    """float64 NumPy attention, [B, S, H, D] layout, GQA by repetition: [o] or [o, dq, dk, dv] when do is given.
    mask broadcasts against [B, H, Sq, Sk]; keep (bool, the same shape) is the dropout mask."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, s, hq, d = q.shape
    g = hq // k.shape[2]
    qt = q.transpose(0, 2, 1, 3)
    kt, vt = (np.repeat(x, g, axis=2).transpose(0, 2, 1, 3) for x in (k, v))
    scale = d ** -0.5
    sc = qt @ kt.swapaxes(-1, -2) * scale
    t = None
    if softcap:
        t = np.tanh(sc / softcap)
        sc = softcap * t
    sc = np.where(mask, sc, -np.inf)
    m = sc.max(-1, keepdims=True)
    p = np.exp(sc - np.where(np.isfinite(m), m, 0.0))
    l = p.sum(-1, keepdims=True)
    p = p / np.where(l > 0, l, 1.0)
    z = 1.0 if keep is None else keep / (1.0 - jaxflash.dropout.effective_rate(rate))  # the kernels' 1/256 steps
    o = (p * z) @ vt
    if do is None:
        return [o.transpose(0, 2, 1, 3)]
    dot = np.asarray(do, np.float64).transpose(0, 2, 1, 3)
    dp = dot @ vt.swapaxes(-1, -2) * z
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    if t is not None:
        ds = ds * (1 - t * t)
    dq = ds @ kt * scale
    dk = ds.swapaxes(-1, -2) @ qt * scale
    dv = (p * z).swapaxes(-1, -2) @ dot

    def fold(x):  # [B, Hq, S, D] -> [B, S, Hkv, D], summed over each GQA group
        return x.transpose(0, 2, 1, 3).reshape(b, x.shape[2], hq // g, g, d).sum(3)

    return [o.transpose(0, 2, 1, 3), dq.transpose(0, 2, 1, 3), fold(dk), fold(dv)]


def check_error(impl, case, pass_, hq, hkv, d, dtype):
    """max |impl - oracle| / max |oracle| over every output, on B=1, S=300 of the same config (S=384 for the
    implementations whose kernels need S to be a multiple of their block)."""
    b, s = 1, CHECK_LEN.get(impl, 300)
    hq, hkv = (2, 2) if hq == hkv else (hq // hkv, 1)
    args = inputs(99, b, s, hq, hkv, d, dtype, pass_)
    kw = case.kwargs(b, s)
    n = jax.device_count()
    zz = impl == "ring-zigzag"
    got = make_fn(impl, kw, pass_)(*place(impl, [jaxflash.zigzag(x, n) for x in args] if zz else args))
    got = [got] if pass_ == "fwd" else list(got)
    if zz:
        got = [jaxflash.unzigzag(g, n) for g in got]
    mask = np.asarray(jaxflash.reference.visible(s, s, causal=case.causal, window=kw.get("window"),
                                                 q_segment_ids=kw.get("q_segment_ids"),
                                                 kv_segment_ids=kw.get("kv_segment_ids")))
    keep = None
    if case.dropout:
        keep = np.asarray(jaxflash.dropout_mask(kw["dropout_key"], b, hq, s, s, case.dropout))
    want = oracle(*args[:3], args[3] if pass_ == "fwdbwd" else None, mask=mask, keep=keep, rate=case.dropout,
                  softcap=case.softcap)
    return max(float(np.max(np.abs(np.asarray(g, np.float64) - w)) / max(float(np.max(np.abs(w))), 1e-30))
               for g, w in zip(got, want))


# --- measurement ------------------------------------------------------------------------------------------

_CUPTI = None


def device_ms(f, sets, reps):
    """Median time of one call in ms, and the method: CUPTI device time on a GPU (back-to-back wall time where
    CUPTI is unavailable), synchronised wall time per call on the CPU."""
    global _CUPTI
    if jax.default_backend() == "cpu":
        times = []
        for args in sets:
            for _ in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(f(*args))
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), "wall"
    if _CUPTI is None:
        try:
            from jax.experimental.mosaic.gpu import profiler

            _, t = profiler.measure(f, iterations=2)(*sets[0])
            if t is None:
                raise RuntimeError("measure returned no time")
            _CUPTI = profiler
        except Exception as e:  # noqa: BLE001
            print(f"# CUPTI unavailable ({type(e).__name__}: {e}); timing back-to-back calls", flush=True)
            _CUPTI = False
    if _CUPTI:
        times = []
        for args in sets:
            _, t = _CUPTI.measure(f, iterations=reps)(*args)
            times += list(t)
        return statistics.median(times), "cupti"
    times = []
    for args in sets:
        jax.block_until_ready(f(*args))
        t0 = time.perf_counter()
        for _ in range(2 * reps):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) * 1e3 / (2 * reps))
    return statistics.median(times), "back-to-back"


def interleaved_ms(calls, reps):
    """Median wall time in ms of each (f, args) of `calls`, timed round-robin: `reps` rounds of one synchronised
    call of each, the first of each round rotating, so load from other jobs hits all alike (CPU)."""
    times = [[] for _ in calls]
    for r in range(reps):
        for i in (np.arange(len(calls)) + r) % len(calls):
            f, args = calls[i]
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[i].append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def kernel_breakdown(f, args, iterations=3):
    """[(kernel name, median ms)] of one call, in launch order (CUPTI only)."""
    if not _CUPTI:
        return []
    _, per_iter = _CUPTI.measure(f, aggregate=False, iterations=iterations)(*args)
    names = [name for name, _ in per_iter[0]]
    return [(name, statistics.median(it[i][1] for it in per_iter)) for i, name in enumerate(names)]


def peak_mb(f, args):
    """MB of XLA's buffer assignment for the compiled call: arguments + outputs + temporaries - aliased."""
    try:
        m = f.lower(*args).compile().memory_analysis()
        total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
        return total / 2**20
    except Exception:  # noqa: BLE001  (not every backend/version reports it)
        return float("nan")


# --- the suites -------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Job:
    """One shape and case, timed for each of `impls`; speedups are against the row (base_case, base_impl),
    None meaning this job's case / the row's own impl."""
    suite: str
    case: Case
    pass_: str
    b: int
    hq: int
    hkv: int
    s: int
    d: int
    impls: list
    base_case: str | None = None
    base_impl: str | None = None


# jaxflash's performance targets on an H100/H200 (bf16, the Hopper kernels): (suite, case, pass, D, S) -> at least
# this many TFLOP/s ("TF"), or at least this speedup over the same implementation without the feature ("x").
TARGETS = {
    ("targets", "full", "fwd", 128, 16384): (680, "TF"),
    ("targets", "causal", "fwd", 128, 16384): (650, "TF"),
    ("targets", "full", "fwd", 128, 4096): (650, "TF"),
    ("targets", "full", "fwd", 128, 1024): (590, "TF"),
    ("targets", "full", "fwd", 64, 16384): (470, "TF"),
    ("targets", "full", "fwd", 256, 16384): (720, "TF"),
    ("targets", "full", "fwdbwd", 128, 16384): (580, "TF"),
    ("targets", "causal", "fwdbwd", 128, 16384): (560, "TF"),
    ("targets", "full", "fwdbwd", 128, 4096): (570, "TF"),
    ("targets", "full", "fwdbwd", 128, 1024): (480, "TF"),
    ("targets", "full", "fwdbwd", 64, 16384): (450, "TF"),
    ("targets", "full", "fwdbwd", 256, 16384): (420, "TF"),
    ("masks", "causal", "fwd", 128, 16384): (1.8, "x"),
    ("masks", "window", "fwd", 128, 16384): (10, "x"),
    ("masks", "docs", "fwd", 128, 16384): (8, "x"),
    ("masks", "softcap", "fwd", 128, 16384): (1 / 1.1, "x"),  # softcap costs at most 10%
    ("masks", "softcap", "fwdbwd", 128, 16384): (1 / 1.15, "x"),
    ("dropout", "dropout", "fwd", 128, 16384): (1 / 1.2, "x"),  # dropout costs at most 20% of the forward
    ("dropout", "dropout", "fwdbwd", 128, 16384): (1 / 1.25, "x"),  # and 25% of forward+backward
    # ring-zigzag on two GPUs: at most 0.6x the single-GPU time of the same call (the `ring` impl's row)
    ("ring", "causal", "fwdbwd", 128, 131072): (1 / 0.6, "x"),
}


def plan(args, gpu):
    """The jobs of args.suite, in run order."""
    peers = [n for n in IMPLS if n not in ("jaxflash", "jaxflash-det", "reference", "cudnn", "xla", *RING)]
    impls = args.impls or (["jaxflash", "cudnn", "xla", *peers] if gpu else ["jaxflash", "xla"])
    # Standard attention, the baseline of the speedups: XLA's; on the CPU the reference when only it is asked for.
    standard = "reference" if not gpu and "reference" in impls and "xla" not in impls else "xla"

    def shape(s, d):
        if gpu:
            return args.batch or max(TOKENS // s, 1), args.heads or WIDTH // d
        return args.batch or 1, args.heads or 4

    def job(suite, case, pass_, s, d, names, b=None, h=None, hkv=None, **base):
        b0, h0 = shape(s, d)
        b, h = b or b0, h or h0
        gqa = {"gqa": True} if hkv and hkv != h else {}
        names = [n for n in names if supports(n, {**case.kwargs(1, 16), **gqa})]
        return Job(suite, case, pass_, b, h, hkv or h, s, d, names, **base)

    jobs = []
    if args.suite == "sweep":
        dims = args.head_dims or ([64, 128, 256] if gpu and not args.quick else [64, 128])
        seqs = args.seqlens or ([1024, 16384] if gpu and args.quick else
                                [512, 1024, 2048, 4096, 8192, 16384] if gpu else [256, 1024, 2048, 4096])
        for pass_ in args.passes:
            for d in dims:
                for case in (FULL, CAUSAL):
                    jobs += [job("sweep", case, pass_, s, d, impls, base_impl=standard) for s in seqs]
            if gpu and not args.quick:
                for case in (FULL, CAUSAL):
                    jobs.append(job("sweep", case, pass_, 8192, 128, impls, b=2, h=64, hkv=8, base_impl=standard))
                    s_mem = 131072 if pass_ == "fwd" else 65536  # the memory case
                    jobs.append(job("sweep", case, pass_, s_mem, 128, ["jaxflash"], b=1, h=16))
    elif args.suite == "targets":
        if not gpu:
            raise SystemExit("jaxflash.bench: --suite targets holds H100/H200 numbers; it needs a GPU")
        shapes = [(FULL, 128, 16384), (CAUSAL, 128, 16384), (FULL, 128, 4096), (FULL, 128, 1024), (FULL, 64, 16384),
                  (FULL, 256, 16384)]
        jobs = [job("targets", c, p, s, d, impls, base_impl=standard) for p in args.passes for c, d, s in shapes]
    elif args.suite in ("masks", "dropout"):
        d = (args.head_dims or [128])[0]
        seqs = args.seqlens or ([16384] if gpu else [2048])
        cases = MASKS if args.suite == "masks" else (FULL, DROPOUT)
        if args.suite == "dropout":  # only those that can drop out
            impls = [n for n in impls if supports(n, DROPOUT.kwargs(1, 16))]
        jobs = [job(args.suite, c, p, s, d, impls, base_case="full") for p in args.passes for s in seqs for c in cases]
    elif args.suite == "ring":
        if jax.device_count() < 2:
            raise SystemExit("jaxflash.bench: --suite ring splits the sequence over two or more devices; this "
                             f"process sees {jax.device_count()}")
        names = args.impls or ["jaxflash", *RING]
        b, h = args.batch or 1, args.heads or (16 if gpu else 2)
        for pass_ in args.passes:
            for s in args.seqlens or ([131072] if gpu else [1024]):
                jobs.append(job("ring", CAUSAL, pass_, s, (args.head_dims or [128])[0], names, b=b, h=h,
                                base_impl="jaxflash"))
    elif args.suite == "seed":
        names = [n for n in impls if n != standard] + [standard]  # the baseline last
        for pass_ in args.passes:
            for s in args.seqlens or [1024, 8192]:
                b, h = (None, None) if gpu else (1, 1)  # CPU: one head keeps the materialised 8k x 8k small
                jobs.append(job("seed", FULL, pass_, s, (args.head_dims or [128])[0], names, b=b, h=h,
                                base_impl=standard))
    return jobs


def xla_skips(impl, job, args):
    """The materialising implementations run out of memory or time past --xla-max-seq (not in the seed suite)."""
    limit = args.xla_max_seq or (8192 if job.pass_ == "fwd" else 4096)
    return impl in ("xla", "reference") and job.suite != "seed" and job.s > limit and jax.default_backend() != "cpu"


# --- running ----------------------------------------------------------------------------------------------

def run(jobs, args, dtype):
    cpu = jax.default_backend() == "cpu"
    total = sum(len(j.impls) for j in jobs)
    checked = {}  # (impl, case, pass, d, GQA) -> (status, error): one check per configuration
    rows, n = [], 0
    for job in jobs:
        sets, ready = None, []  # ready: (row, f) warmed up, timed together after the loop (CPU)
        for impl in job.impls:
            n += 1
            print(f"[{n:>3}/{total}] {job.suite} {job.case.label} {job.pass_} d={job.d} s={job.s} b={job.b} "
                  f"h={job.hq}/{job.hkv} {impl}", file=sys.stderr, flush=True)
            row = dict(suite=job.suite, case=job.case.label, impl=impl, pass_=job.pass_, d=job.d, s=job.s, b=job.b,
                       hq=job.hq, hkv=job.hkv, causal=int(job.case.causal), dtype=jnp.dtype(dtype).name, status="ok",
                       ms=float("nan"), tflops=float("nan"), peak_mb=float("nan"), check_err=float("nan"),
                       method="")
            rows.append(row)
            if xla_skips(impl, job, args):
                row["status"] = "skip (materialises S^2)"
                continue
            key = (impl, job.case, job.pass_, job.d, job.hq // job.hkv, job.hq == job.hkv)
            try:
                if key not in checked:
                    err = check_error(impl, job.case, job.pass_, job.hq, job.hkv, job.d, dtype)
                    tol = 1e-3 if jnp.dtype(dtype) == jnp.float32 else 2e-2
                    checked[key] = ("ok" if err <= tol else f"WRONG (error {err:.2e} > {tol})", err)
                    print(f"# check {impl} {job.case.label} {job.pass_} d={job.d}: max rel error {err:.2e} vs the "
                          f"float64 oracle: {'ok' if err <= tol else 'CHECK FAILED'}", flush=True)
                row["status"], row["check_err"] = checked[key]
                if row["status"] != "ok":
                    continue
                if sets is None:  # two input sets larger than L2 on a GPU; one on the CPU
                    sets = [inputs(i, job.b, job.s, job.hq, job.hkv, job.d, dtype, job.pass_)
                            for i in range(1 if jax.default_backend() == "cpu" else 2)]
                f = make_fn(impl, job.case.kwargs(job.b, job.s), job.pass_)
                placed = [place(impl, a) for a in sets]
                jax.block_until_ready(f(*placed[0]))  # compile and warm up
                if cpu:
                    ready.append((row, f, placed[0]))
                    continue
                _record(row, job, f, placed, *device_ms(f, placed, args.reps))
                if args.breakdown and impl.startswith("jaxflash"):
                    for name, ms in kernel_breakdown(f, placed[0]):
                        print(f"KERNEL impl={impl} case={job.case.label} pass={job.pass_} d={job.d} s={job.s} "
                              f"ms={ms:.4f} name={name[:90]}", flush=True)
            except NotImplementedError:  # a feature this backend does not have yet
                checked[key] = ("n/a (not implemented)", float("nan"))
                row["status"] = checked[key][0]
            except Exception as e:  # noqa: BLE001  (a peer that fails, or memory)
                row["status"] = ("OOM (shared memory)" if "Shared memory size limit" in str(e) else "OOM"
                                 if "RESOURCE_EXHAUSTED" in str(e) else f"error: {type(e).__name__}")
                print(f"# {impl} {job.case.label} {job.pass_} d={job.d} s={job.s}: {type(e).__name__}: "
                      f"{str(e)[:300]}", flush=True)
        if ready:
            times = interleaved_ms([(f, a) for _, f, a in ready], args.reps)
            for (row, f, a), ms in zip(ready, times):
                _record(row, job, f, [a], ms, "wall-interleaved")
        del sets, ready
    _compare(rows, jobs, cpu)
    return rows


def _record(row, job, f, sets, ms, method):
    """Fill a timed row (ms, TFLOP/s, peak memory) and print its RESULT line."""
    row["ms"], row["method"] = ms, method
    row["tflops"] = flops(job.b, job.hq, job.s, job.d, job.case.density(job.s), job.pass_) / ms / 1e9
    row["peak_mb"] = peak_mb(f, sets[0])
    print(f"RESULT suite={job.suite} case={job.case.label} impl={row['impl']} pass={job.pass_} d={job.d} "
          f"s={job.s} b={job.b} h={job.hq} hkv={job.hkv} causal={row['causal']} dtype={row['dtype']} "
          f"ms={ms:.4f} tflops={row['tflops']:.3f} peak_mb={row['peak_mb']:.1f} method={method}",
          flush=True)


def cpu_target(r):
    """The CPU kernel's target for a sweep row, as (speedup over XLA, "x"), or None: float32, B=1, H=4, at least
    1.5x XLA's speed at S >= 1024 and 1.0x at 256 <= S < 1024 (forward and forward+backward)."""
    if (r["suite"], r["impl"], r["vs"], r["dtype"], r["b"], r["hq"], r["hkv"]) != \
            ("sweep", "jaxflash", "xla", "float32", 1, 4, 4) or r["s"] < 256:
        return None
    return (1.5 if r["s"] >= 1024 else 1.0), "x"


def _compare(rows, jobs, cpu=False):
    """Speedup and memory saved against each job's base row, and the verdict against a target."""
    index = {(r["suite"], r["pass_"], r["d"], r["s"], r["b"], r["hq"], r["case"], r["impl"]): r for r in rows}
    bases = {(j.suite, j.pass_, j.d, j.s, j.b, j.hq, j.case.label): j for j in jobs}
    for r in rows:
        job = bases[(r["suite"], r["pass_"], r["d"], r["s"], r["b"], r["hq"], r["case"])]
        base_case, base_impl = job.base_case or r["case"], job.base_impl or r["impl"]
        base = index.get((r["suite"], r["pass_"], r["d"], r["s"], r["b"], r["hq"], base_case, base_impl))
        r["vs"] = f"{base_impl} {base_case}" if job.base_case else base_impl
        r["speedup"] = r["mem_saved"] = float("nan")
        if base is not None and base is not r:
            r["speedup"] = base["ms"] / r["ms"]
            r["mem_saved"] = base["peak_mb"] / r["peak_mb"]
        r["target"] = ""
        t = cpu_target(r) if cpu else TARGETS.get((r["suite"], r["case"], r["pass_"], r["d"], r["s"]))
        if t and r["impl"] == ("ring-zigzag" if r["suite"] == "ring" else "jaxflash") and r["status"] == "ok":
            goal, unit = t
            value = r["tflops"] if unit == "TF" else r["speedup"]
            r["target"] = f">= {goal:.3g}{'x' if unit == 'x' else ' TF/s'}: " + \
                ("met" if value >= goal else f"short {100 * (1 - value / goal):.1f}%")


# --- the decode suite: bandwidth, not FLOPs ---------------------------------------------------------------

DECODE_GPU = dict(heads=(32, 8), shapes=[(1, 1, 131072), (8, 1, 32768), (64, 1, 4096), (8, 4, 32768)])
DECODE_CPU = dict(heads=(8, 2), shapes=[(1, 1, 16384), (8, 1, 4096), (8, 4, 4096)])
# (B, Sq, Sk) -> TB/s of K and V read by jaxflash.attention on an H100/H200; the paged rows within 10 % of it.
DECODE_TARGETS = {(1, 1, 131072): 3.8, (8, 1, 32768): 4.0, (64, 1, 4096): 3.8, (8, 4, 32768): 3.5}
PAGED_WITHIN = 0.9
DECODE_IMPLS = ("jaxflash", "jaxflash-paged16", "jaxflash-paged64", "cudnn", "xla")


def paged_copy(k, v, page_size, seed=0):
    """k, v [B, S, H, D] as paged caches with a shuffled block table: (key_cache, value_cache, block_tables,
    kv_lengths), sequence b's token t in page block_tables[b, t // page_size]."""
    b, s, h, d = k.shape
    n = -(-s // page_size)
    tables = jnp.asarray(np.random.default_rng(seed).permutation(b * n).reshape(b, n), jnp.int32)
    pad = [(0, 0), (0, n * page_size - s), (0, 0), (0, 0)]

    def cache(x):
        pages = jnp.pad(x, pad).reshape(b * n, page_size, h, d)
        return jnp.zeros_like(pages).at[tables.reshape(-1)].set(pages)

    return cache(k), cache(v), tables, jnp.full((b,), s, jnp.int32)


def decode_fn(impl):
    """(jitted attention, how it takes its inputs from (q, k, v))."""
    if impl.startswith("jaxflash-paged"):
        page = int(impl.removeprefix("jaxflash-paged"))
        return (jax.jit(lambda q, kc, vc, t, n: jaxflash.paged_attention(q, kc, vc, t, n)),
                lambda q, k, v: (q, *paged_copy(k, v, page)))
    if impl == "jaxflash":
        return jax.jit(lambda q, k, v: jaxflash.attention(q, k, v)), lambda q, k, v: (q, k, v)
    return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=impl)), \
        lambda q, k, v: (q, k, v)


def run_decode(args, dtype, gpu):
    """Check each implementation on a small cache against the float64 oracle, then time every shape."""
    cfg = DECODE_GPU if gpu else DECODE_CPU
    hq, hkv = cfg["heads"]
    d = (args.head_dims or [128])[0]
    impls = [n for n in (args.impls or DECODE_IMPLS) if gpu or n != "cudnn"]
    shapes = ([(args.batch or b, sq, s) for b, sq, s in cfg["shapes"]] if not args.seqlens else
              [(args.batch or 1, sq, s) for s in args.seqlens for sq in (1, 4)])
    tol = 1e-3 if jnp.dtype(dtype) == jnp.float32 else 2e-2
    status = {}
    for impl in impls:  # one check per implementation: B=2, Sq=3, 300 cached tokens (a partial last page)
        f, prep = decode_fn(impl)
        q, k, v = inputs(99, 2, 300, hq, hkv, d, dtype, "fwd")
        q = q[:, :3]
        try:
            got = f(*prep(q, k, v))
        except NotImplementedError:
            status[impl] = "n/a (not implemented)"
            continue
        except Exception as e:  # noqa: BLE001  (a peer that fails)
            status[impl] = f"error: {type(e).__name__}"
            print(f"# {impl} decode: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        want = oracle(q, k, v, None, mask=np.ones((1, 1, 3, 300), bool))[0]
        err = float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))
        status[impl] = "ok" if err <= tol else f"WRONG (error {err:.2e} > {tol})"
        print(f"# check {impl} decode d={d}: max rel error {err:.2e} vs the float64 oracle: "
              f"{'ok' if err <= tol else 'CHECK FAILED'}", flush=True)
    rows = []
    for b, sq, s in shapes:
        sets = [inputs(i, b, s, hq, hkv, d, dtype, "fwd") for i in range(2 if gpu else 1)]  # caches > L2
        sets = [(q[:, :sq], k, v) for q, k, v in sets]
        q, k, _ = sets[0]
        nbytes = (2 * k.size + 2 * q.size) * jnp.dtype(dtype).itemsize  # K + V + Q + O
        kv_bytes = 2 * k.size * jnp.dtype(dtype).itemsize
        ready = []
        for impl in impls:
            row = dict(suite="decode", impl=impl, b=b, sq=sq, s=s, hq=hq, hkv=hkv, d=d, dtype=jnp.dtype(dtype).name,
                       status=status[impl], ms=float("nan"), gbps=float("nan"), kv_gbps=float("nan"), target="")
            rows.append(row)
            if row["status"] != "ok":
                continue
            print(f"[decode] b={b} sq={sq} sk={s} h={hq}/{hkv} {impl}", file=sys.stderr, flush=True)
            f, prep = decode_fn(impl)
            try:
                placed = [jax.block_until_ready(prep(*x)) for x in sets]
                jax.block_until_ready(f(*placed[0]))
            except Exception as e:  # noqa: BLE001  (memory)
                row["status"] = "OOM" if "RESOURCE_EXHAUSTED" in str(e) else f"error: {type(e).__name__}"
                continue
            if gpu:
                row["ms"], row["method"] = device_ms(f, placed, args.reps)
            else:
                ready.append((row, f, placed[0]))
            del placed
        if ready:
            for (row, _, _), ms in zip(ready, interleaved_ms([(f, a) for _, f, a in ready], args.reps)):
                row["ms"], row["method"] = ms, "wall-interleaved"
        for row in rows[-len(impls):]:
            if row["status"] != "ok":
                continue
            row["gbps"], row["kv_gbps"] = nbytes / row["ms"] / 1e6, kv_bytes / row["ms"] / 1e6
            print(f"RESULT suite=decode impl={row['impl']} d={d} b={b} sq={sq} sk={s} h={hq} hkv={hkv} "
                  f"dtype={row['dtype']} ms={row['ms']:.4f} gbps={row['gbps']:.1f} method={row['method']}", flush=True)
        _decode_targets(rows[-len(impls):], gpu)
    return rows


def _decode_targets(rows, gpu):
    """The contiguous jaxflash row against its K+V bandwidth target (GPU), each paged row against it."""
    base = next((r for r in rows if r["impl"] == "jaxflash" and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] != "ok":
            continue
        if r["impl"] == "jaxflash" and gpu and (r["b"], r["sq"], r["s"]) in DECODE_TARGETS:
            goal = DECODE_TARGETS[(r["b"], r["sq"], r["s"])]
            r["target"] = f">= {goal} TB/s K+V: " + ("met" if r["kv_gbps"] >= goal * 1e3 else
                                                    f"short {100 * (1 - r['kv_gbps'] / goal / 1e3):.1f}%")
        elif r["impl"].startswith("jaxflash-paged") and base is not None:
            ratio = base["ms"] / r["ms"]
            r["target"] = f"{ratio:.2f}x contiguous"
            if gpu:
                r["target"] += f" (>= {PAGED_WITHIN}): " + (
                    "met" if ratio >= PAGED_WITHIN else f"short {100 * (1 - ratio / PAGED_WITHIN):.1f}%")


def decode_table(rows):
    head = f"{'B':>4}{'Sq':>4}{'Sk':>8}{'H':>7}  {'impl':18}{'ms':>10}{'GB/s':>9}{'K+V GB/s':>10}  target / status"
    lines = [head, "-" * len(head)]
    for r in rows:
        heads = f"{r['hq']}/{r['hkv']}"
        line = f"{r['b']:>4}{r['sq']:>4}{r['s']:>8}{heads:>7}  {r['impl']:18}"
        if r["status"] != "ok":
            lines.append(line + f"{'':>29}  {r['status']}")
        else:
            lines.append(line + f"{r['ms']:10.3f}{r['gbps']:9.1f}{r['kv_gbps']:10.1f}  {r['target']}")
    return "\n".join(lines)


# --- output -----------------------------------------------------------------------------------------------

COLUMNS = ["suite", "case", "pass_", "d", "s", "b", "hq", "hkv", "causal", "dtype", "impl", "status", "check_err",
           "ms", "tflops", "peak_mb", "vs", "speedup", "mem_saved", "target", "method"]


def table(rows, gpu):
    unit, scale = ("TFLOP/s", 1.0) if gpu else ("GFLOP/s", 1e3)
    head = (f"{'suite':8}{'case':9}{'pass':7}{'D':>4}{'S':>7}{'B':>4}{'H':>7}  {'impl':15}{'ms':>10}{unit:>9}"
            f"{'peak MB':>10}  {'vs':16}{'speedup':>8}{'mem':>8}  target / status")
    lines = [head, "-" * len(head)]
    for r in rows:
        h = f"{r['hq']}/{r['hkv']}" if r["hq"] != r["hkv"] else str(r["hq"])
        line = f"{r['suite']:8}{r['case']:9}{r['pass_']:7}{r['d']:>4}{r['s']:>7}{r['b']:>4}{h:>7}  {r['impl']:15}"
        if r["status"] != "ok":
            lines.append(line + f"{'':>37}  {'':16}{'':>16}  {r['status']}")
            continue
        speed = "" if math.isnan(r["speedup"]) else f"{r['speedup']:.2f}x"
        mem = "" if math.isnan(r["mem_saved"]) else f"{r['mem_saved']:.1f}x"
        lines.append(line + f"{r['ms']:10.3f}{r['tflops'] * scale:9.1f}{r['peak_mb']:10.1f}  "
                            f"{r['vs'] if speed else '':16}{speed:>8}{mem:>8}  {r['target']}")
    return "\n".join(lines)


def write(out, rows, meta):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({c: r[c] for c in COLUMNS} for r in rows)
    with open(os.path.join(out, "results.json"), "w") as fh:
        clean = [{c: (None if isinstance(r[c], float) and math.isnan(r[c]) else r[c]) for c in COLUMNS} for r in rows]
        json.dump({"meta": meta, "rows": clean}, fh, indent=1)
    plot(rows, os.path.join(out, "tflops.png"))


def plot(rows, path):
    """TFLOP/s against S, one line per implementation, one panel per (suite, pass, D, case)."""
    import matplotlib  # lazily: only --out needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    panels = sorted({(r["suite"], r["pass_"], r["d"], r["case"]) for r in ok})
    cols = min(len(panels), 4) or 1
    nrows = max(math.ceil(len(panels) / cols), 1)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, (suite, pass_, d, case) in zip(axes.flat, panels):
        for impl in dict.fromkeys(r["impl"] for r in ok):
            pts = sorted((r["s"], r["tflops"]) for r in ok if (r["suite"], r["pass_"], r["d"], r["case"], r["impl"])
                         == (suite, pass_, d, case, impl) and r["hq"] == r["hkv"])
            if pts:
                ax.plot(*zip(*pts), "o-", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{suite}: {pass_}, D={d}, {case}", fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m jaxflash.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--suite", default="sweep", choices=SUITES)
    p.add_argument("--impls", nargs="+", help=f"subset of {', '.join(IMPLS)} and importable peers (decode: "
                                               f"{', '.join(DECODE_IMPLS)})")
    p.add_argument("--seqlens", "--seqs", type=int, nargs="+")
    p.add_argument("--head-dims", "--head-dim", type=int, nargs="+")
    p.add_argument("--heads", type=int, help="default: 2048 / D on a GPU, 4 on the CPU")
    p.add_argument("--batch", type=int, help="default: 16384 / S on a GPU, 1 on the CPU")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 GPU, float32 CPU")
    p.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES)
    p.add_argument("--reps", type=int, default=None,
                   help="timed calls per input set (default: 10 on a GPU, which times 2 sets; 20 on the CPU)")
    p.add_argument("--quick", action="store_true", help="GPU sweep: D in {64, 128}, S in {1k, 16k}, no extras")
    p.add_argument("--xla-max-seq", type=int, help="skip the materialising impls above this S (default 8k fwd, "
                                                    "4k fwd+bwd; GPU)")
    p.add_argument("--breakdown", action="store_true", help="per-kernel device times of the jaxflash calls (CUPTI)")
    p.add_argument("--out", help="directory for results.csv, results.json and tflops.png")
    args = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    if gpu:
        _add_peers()
    args.reps = args.reps or (10 if gpu else 20)  # >= 20 timed runs per implementation either way
    dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
    known = DECODE_IMPLS if args.suite == "decode" else IMPLS
    unknown = set(args.impls or []) - set(known)
    if unknown:
        p.error(f"unknown or unavailable --impls {sorted(unknown)}; have {sorted(known)}")
    dev = jax.devices()[0]
    meta = dict(device=dev.device_kind, backend=jax.default_backend(), jax=jax.__version__,
                jaxflash=jaxflash.__version__, python=platform.python_version(), suite=args.suite,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                argv=sys.argv[1:] if argv is None else list(argv), dtype=dtype.name, reps=args.reps,
                check="float64 NumPy oracle on B=1, S=300 (384: pallas) of the same config; max error / max "
                      "|oracle|",
                memory="XLA buffer assignment of the compiled call: arguments + outputs + temporaries - aliased")
    print(f"jaxflash.bench --suite {args.suite} on {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__},"
          f" {dtype.name}", flush=True)
    if args.suite == "decode":
        rows = run_decode(args, dtype, gpu)
        print()
        print(decode_table(rows))
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "results.json"), "w") as fh:
                json.dump({"meta": meta, "rows": rows}, fh, indent=1, default=str)
            print(f"\nwrote {args.out}/results.json")
        bad = [r for r in rows if r["status"].startswith("WRONG")
               or (r["impl"].startswith("jaxflash") and r["status"].startswith("error"))]
        for r in bad:
            print(f"jaxflash.bench: {r['impl']} decode b={r['b']} sq={r['sq']} sk={r['s']}: {r['status']}",
                  file=sys.stderr)
        return 1 if bad else 0
    rows = run(plan(args, gpu), args, dtype)
    print()
    print(table(rows, gpu))
    verdicts = [r["target"] for r in rows if r["target"]]
    if not gpu and verdicts:
        print(f"\nCPU targets (speedup over XLA): {sum(v.endswith('met') for v in verdicts)} of {len(verdicts)} met")
    if args.out:
        write(args.out, rows, meta)
        print(f"\nwrote {args.out}/results.csv, results.json, tflops.png")
    bad = [r for r in rows if r["status"].startswith("WRONG")
           or (r["impl"] == "jaxflash" and r["status"].startswith("error"))]
    for r in bad:
        print(f"jaxflash.bench: {r['impl']} {r['case']} {r['pass_']} d={r['d']}: {r['status']}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
