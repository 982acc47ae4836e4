"""Forward-pass benchmark of the CUDA kernel against jax.nn.dot_product_attention (xla, cudnn), one run.

Protocol (shared/BENCH.md): bf16, random normal inputs, 16k tokens and model width 2048 (B = 16384 / S,
H = 2048 / D), D in {64, 128, 256}, S in {512 .. 16k}, causal off and on; FLOPs 4·B·H·S²·D, halved when
causal. Each implementation is first checked against the float64 oracle on a small case of the same
config; then device time is read by CUPTI (jax.experimental.mosaic.gpu.profiler.measure, summing every
kernel of one call), 10 calls on each of two input sets larger than L2, median reported. Where CUPTI is
unavailable, events-free fallback: wall time of 20 back-to-back calls with one final block_until_ready.
Prints one `RESULT ...` line per measurement and a table at the end. Also the memory case
B=1, H=16, D=128, S=131072 (jaxflash only).

  python benchmarks/bench_gpu.py [--quick] [--dims 64,128] [--seqs 1024,16384] [--impls jaxflash,cudnn]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import oracle  # noqa: E402

import jaxflash  # noqa: E402

TOKENS, WIDTH = 16384, 2048


def impl_fn(name, causal):
    if name == "jaxflash":
        return jax.jit(lambda q, k, v: jaxflash.attention(q, k, v, causal=causal, backend="cuda"))
    return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=name))


def inputs(seed, b, s, h, d):
    key = jax.random.key(seed)
    return [jax.random.normal(jax.random.fold_in(key, i), (b, s, h, d), jnp.bfloat16) for i in range(3)]


def refcheck(name, d, causal):
    """max |impl - float64 oracle| on B=1, S=300, H=2; bf16 output rounding alone is ~4e-3."""
    q, k, v = inputs(99, 1, 300, 2, d)
    out = np.asarray(impl_fn(name, causal)(q, k, v), np.float64)
    ref, _ = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), causal=causal)
    return float(np.max(np.abs(out - ref)))


_CUPTI = None


def device_ms(f, sets, reps=10):
    """Median device time of one call, in ms."""
    global _CUPTI
    if _CUPTI is None:
        try:
            from jax.experimental.mosaic.gpu import profiler

            _CUPTI = profiler
            _, t = profiler.measure(f, iterations=2)(*sets[0])
            assert t is not None
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


def flops(b, h, sq, sk, d, causal):
    return 4 * b * h * sq * sk * d / (2 if causal else 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="D in {64,128}, S in {1k, 16k}")
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--seqs", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--impls", default="jaxflash,cudnn,xla")
    ap.add_argument("--xla-max-seq", type=int, default=8192, help="xla materialises S²: skip it above this")
    ap.add_argument("--no-memory-case", action="store_true")
    args = ap.parse_args()
    dims = [64, 128] if args.quick else [int(x) for x in args.dims.split(",")]
    seqs = [1024, 16384] if args.quick else [int(x) for x in args.seqs.split(",")]
    impls = args.impls.split(",")

    dev = jax.devices()[0]
    print(f"# device {dev.device_kind}, jax {jax.__version__}", flush=True)
    table = {}
    for d in dims:
        for causal in (False, True):
            ok = {}
            for name in impls:
                try:
                    err = refcheck(name, d, causal)
                    ok[name] = err < 2e-2
                    print(f"# refcheck {name} d={d} causal={int(causal)}: max err {err:.2e} "
                          f"{'ok' if ok[name] else 'FAIL'}", flush=True)
                except Exception as e:  # noqa: BLE001
                    ok[name] = False
                    print(f"# refcheck {name} d={d} causal={int(causal)}: {type(e).__name__}: {str(e)[:200]}")
            for s in seqs:
                b, h = TOKENS // s, WIDTH // d
                sets = [inputs(i, b, s, h, d) for i in range(2)]
                for name in impls:
                    key = (d, s, int(causal), name)
                    if not ok[name]:
                        table[key] = "refFAIL"
                        continue
                    if name == "xla" and s > args.xla_max_seq:
                        table[key] = "skip"
                        continue
                    try:
                        f = impl_fn(name, causal)
                        jax.block_until_ready(f(*sets[0]))
                        ms, method = device_ms(f, sets)
                        tf = flops(b, h, s, s, d, causal) / ms / 1e9
                        table[key] = f"{tf:.0f}"
                        print(f"RESULT impl={name} d={d} s={s} b={b} h={h} causal={int(causal)} pass=fwd "
                              f"ms={ms:.4f} tflops={tf:.1f} method={method}", flush=True)
                    except Exception as e:  # noqa: BLE001
                        table[key] = "OOM" if "RESOURCE_EXHAUSTED" in str(e) else "err"
                        print(f"# {name} d={d} s={s} causal={int(causal)}: {type(e).__name__}: {str(e)[:200]}")
                del sets

    if not args.no_memory_case and "jaxflash" in impls:
        for causal in (False, True):
            b, h, s, d = 1, 16, 131072, 128
            try:
                q, k, v = inputs(5, b, s, h, d)
                f = impl_fn("jaxflash", causal)
                o = jax.block_until_ready(f(q, k, v))
                finite = bool(jnp.isfinite(o.astype(jnp.float32)).all())
                ms, method = device_ms(f, [(q, k, v)], reps=2)
                tf = flops(b, h, s, s, d, causal) / ms / 1e9
                print(f"RESULT impl=jaxflash d={d} s={s} b={b} h={h} causal={int(causal)} pass=fwd ms={ms:.2f} "
                      f"tflops={tf:.1f} method={method} memory_case=1 finite={finite}", flush=True)
                table[(d, s, int(causal), "jaxflash")] = f"{tf:.0f}" + ("" if finite else " NaN!")
                del q, k, v, o
            except Exception as e:  # noqa: BLE001
                print(f"# memory case causal={int(causal)}: {type(e).__name__}: {str(e)[:200]}")

    print()
    print("TFLOP/s (bf16 forward, device time)")
    print(f"{'D':>4} {'S':>6} {'causal':>6} " + " ".join(f"{n:>9}" for n in impls))
    for d, s, c in sorted({k[:3] for k in table}):
        print(f"{d:>4} {s:>6} {c:>6} " + " ".join(f"{table.get((d, s, c, n), '-'):>9}" for n in impls))


if __name__ == "__main__":
    main()
