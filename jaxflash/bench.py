"""`python -m jaxflash.bench`: time jaxflash against the materialising reference.

On the CPU it times the C++ kernel against `jaxflash.reference` on a few shapes, after checking that
they agree, and prints one `RESULT` line per measurement and a table (ms, GFLOP/s, XLA's temporary
memory). FLOPs follow the FlashAttention convention: forward 4*B*H*Sq*Sk*D, halved when causal;
forward+backward 3.5x that. The GPU sweep lives in benchmarks/bench_gpu.py.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash

IMPLS = {
    "jaxflash": lambda q, k, v, causal: jaxflash.attention(q, k, v, causal=causal),
    "reference": lambda q, k, v, causal: jaxflash.reference.attention(q, k, v, causal=causal),
}


def _loss(impl, causal):
    return lambda q, k, v: jnp.sum(IMPLS[impl](q, k, v, causal).astype(jnp.float32))


def make_fn(impl, causal, pass_):
    if pass_ == "fwd":
        return jax.jit(lambda q, k, v: IMPLS[impl](q, k, v, causal))
    return jax.jit(jax.grad(_loss(impl, causal), argnums=(0, 1, 2)))


def flops(b, h, s, d, causal, pass_):
    f = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    return f * (3.5 if pass_ == "fwdbwd" else 1.0)


def time_ms(fn, args, reps):
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), statistics.pstdev(times)


def temp_bytes(fn, args):
    """Bytes of temporaries XLA allocates for the compiled call: the N x N score matrix shows here."""
    try:
        return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
    except Exception:  # memory analysis is not available on every backend/version
        return float("nan")


def check(causal, pass_, b, h, s, d, dtype):
    """jaxflash vs reference on the same inputs; raises if they disagree."""
    q, k, v = _inputs(b, h, min(s, 256), d, dtype, seed=1)
    got = make_fn("jaxflash", causal, pass_)(q, k, v)
    want = make_fn("reference", causal, pass_)(q, k, v)
    tol = 2e-2 if dtype != jnp.float32 else 1e-3
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
        if not err <= tol:
            raise SystemExit(f"jaxflash.bench: jaxflash and reference disagree ({err:.3g} > {tol})")


def _inputs(b, h, s, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal((b, s, h, d), np.float32), dtype) for _ in range(3)]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m jaxflash.bench", description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--passes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    b, h, d = args.batch, args.heads, args.head_dim
    print(f"jaxflash.bench on {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"{args.dtype}, B={b} H={h} D={d}, median of {args.reps}", flush=True)
    rows = []
    for pass_ in args.passes:
        for causal in (False, True):
            check(causal, pass_, b, h, 256, d, dtype)
            for s in args.seqlens:
                q, k, v = _inputs(b, h, s, d, dtype)
                res = {}
                for impl in IMPLS:
                    fn = make_fn(impl, causal, pass_)
                    ms, sd = time_ms(fn, (q, k, v), args.reps)
                    mem = temp_bytes(fn, (q, k, v))
                    gflops = flops(b, h, s, d, causal, pass_) / ms / 1e6
                    res[impl] = (ms, gflops, mem)
                    print(f"RESULT impl={impl} pass={pass_} causal={int(causal)} b={b} h={h} s={s} d={d} "
                          f"dtype={args.dtype} ms={ms:.3f} sd={sd:.3f} gflops={gflops:.2f} temp_mb={mem / 2**20:.2f}",
                          flush=True)
                rows.append((pass_, causal, s, res))
    print()
    head = f"{'pass':7}{'causal':>7}{'S':>7} | {'jaxflash ms':>12}{'GFLOP/s':>9}{'temp MB':>9} | " \
           f"{'reference ms':>13}{'GFLOP/s':>9}{'temp MB':>9} | {'speedup':>8}"
    print(head)
    print("-" * len(head))
    for pass_, causal, s, res in rows:
        (fm, fg, fmem), (rm, rg, rmem) = res["jaxflash"], res["reference"]
        print(f"{pass_:7}{'yes' if causal else 'no':>7}{s:>7} | {fm:12.2f}{fg:9.2f}{fmem / 2**20:9.2f} | "
              f"{rm:13.2f}{rg:9.2f}{rmem / 2**20:9.2f} | {rm / fm:7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
