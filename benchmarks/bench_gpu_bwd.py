"""Forward+backward benchmark of the CUDA kernels against jax.nn.dot_product_attention (xla, cudnn), one run.

Protocol (shared/BENCH.md): bf16, random normal inputs, 16k tokens and model width 2048 (B = 16384 / S,
H = 2048 / D), D in {64, 128, 256}, S in {512 .. 16k}, causal off and on. One timed call is a jitted
forward + backward (jax.vjp, gradients of q, k and v); FLOPs 3.5 x 4·B·H·S²·D, halved when causal. Each
implementation is first checked against the float64 oracle's gradients on a small case of the same config;
then device time is read by CUPTI (jax.experimental.mosaic.gpu.profiler.measure: the sum of every kernel
of one call), 10 calls on each of two input sets larger than L2, median reported; where CUPTI is
unavailable, wall time of 20 back-to-back calls with one final block_until_ready. Also the memory case
B=1, H=16, D=128, S=65536 (jaxflash only), and jaxflash with deterministic=True where --deterministic.
Prints one `RESULT ...` line per measurement and a table last.

  python benchmarks/bench_gpu_bwd.py [--quick] [--dims 64,128] [--seqs 4096,16384] [--impls jaxflash,cudnn]
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


def attention_fn(name, causal):
    if name == "jaxflash":
        return lambda q, k, v: jaxflash.attention(q, k, v, causal=causal, backend="cuda")
    if name == "jaxflash-det":
        return lambda q, k, v: jaxflash.attention(q, k, v, causal=causal, deterministic=True, backend="cuda")
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=name)


def fwd_bwd_fn(name, causal):
    attn = attention_fn(name, causal)

    def f(q, k, v, do):
        o, vjp = jax.vjp(attn, q, k, v)
        return (o, *vjp(do))

    return jax.jit(f)


def inputs(seed, b, s, h, d):
    key = jax.random.key(seed)
    return [jax.random.normal(jax.random.fold_in(key, i), (b, s, h, d), jnp.bfloat16) for i in range(4)]


def refcheck(name, d, causal):
    """max |grad - float64 oracle| / max |oracle| over dq, dk, dv on B=1, S=300, H=2."""
    q, k, v, do = inputs(99, 1, 300, 2, d)
    _, dq, dk, dv = fwd_bwd_fn(name, causal)(q, k, v, do)
    ref = oracle.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), causal=causal,
                           do=np.asarray(do, np.float64))[2:]
    return max(float(np.max(np.abs(np.asarray(g, np.float64) - r)) / np.max(np.abs(r)))
               for g, r in zip((dq, dk, dv), ref))


_CUPTI = None


def device_ms(f, sets, reps=10):
    """Median device time of one call, in ms, and the method."""
    global _CUPTI
    if _CUPTI is None:
        try:
            from jax.experimental.mosaic.gpu import profiler

            _, t = profiler.measure(f, iterations=2)(*sets[0])
            assert t is not None
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


def kernel_breakdown(f, args, iterations=3):
    """[(kernel name, median ms)] of one call, in launch order (CUPTI only)."""
    if not _CUPTI:
        return []
    _, per_iter = _CUPTI.measure(f, aggregate=False, iterations=iterations)(*args)
    names = [name for name, _ in per_iter[0]]
    return [(name, statistics.median(it[i][1] for it in per_iter)) for i, name in enumerate(names)]


def flops(b, h, s, d, causal):
    return 3.5 * 4 * b * h * s * s * d / (2 if causal else 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="D in {64, 128}, S in {4k, 16k}")
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--seqs", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--impls", default="jaxflash,cudnn,xla")
    ap.add_argument("--deterministic", action="store_true", help="also time jaxflash with deterministic=True")
    ap.add_argument("--xla-max-seq", type=int, default=4096, help="xla materialises S²: skip it above this")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-memory-case", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="per-kernel device times of the jaxflash calls")
    args = ap.parse_args()
    dims = [64, 128] if args.quick else [int(x) for x in args.dims.split(",")]
    seqs = [4096, 16384] if args.quick else [int(x) for x in args.seqs.split(",")]
    impls = args.impls.split(",") + (["jaxflash-det"] if args.deterministic else [])

    print(f"# device {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    table = {}
    for d in dims:
        for causal in (False, True):
            ok = {}
            for name in impls:
                try:
                    err = refcheck(name, d, causal)
                    ok[name] = err < 2e-2
                    print(f"# refcheck {name} d={d} causal={int(causal)}: max rel err {err:.2e} "
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
                        f = fwd_bwd_fn(name, causal)
                        jax.block_until_ready(f(*sets[0]))
                        ms, method = device_ms(f, sets, args.reps)
                        tf = flops(b, h, s, d, causal) / ms / 1e9
                        table[key] = f"{tf:.0f}"
                        print(f"RESULT impl={name} d={d} s={s} b={b} h={h} causal={int(causal)} pass=fwdbwd "
                              f"ms={ms:.4f} tflops={tf:.1f} method={method}", flush=True)
                        if args.breakdown and name.startswith("jaxflash"):
                            for kname, kms in kernel_breakdown(f, sets[0]):
                                print(f"KERNEL impl={name} d={d} s={s} causal={int(causal)} ms={kms:.4f} "
                                      f"name={kname[:90]}", flush=True)
                    except Exception as e:  # noqa: BLE001
                        table[key] = "OOM" if "RESOURCE_EXHAUSTED" in str(e) else "err"
                        print(f"# {name} d={d} s={s} causal={int(causal)}: {type(e).__name__}: {str(e)[:200]}")
                del sets

    if not args.no_memory_case and "jaxflash" in impls:
        b, h, s, d = 1, 16, 65536, 128
        for causal in (False, True):
            try:
                q, k, v, do = inputs(5, b, s, h, d)
                f = fwd_bwd_fn("jaxflash", causal)
                out = jax.block_until_ready(f(q, k, v, do))
                finite = all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in out)
                ms, method = device_ms(f, [(q, k, v, do)], reps=2)
                tf = flops(b, h, s, d, causal) / ms / 1e9
                print(f"RESULT impl=jaxflash d={d} s={s} b={b} h={h} causal={int(causal)} pass=fwdbwd ms={ms:.2f} "
                      f"tflops={tf:.1f} method={method} memory_case=1 finite={finite}", flush=True)
                table[(d, s, int(causal), "jaxflash")] = f"{tf:.0f}" + ("" if finite else " NaN!")
                del q, k, v, do, out
            except Exception as e:  # noqa: BLE001
                print(f"# memory case causal={int(causal)}: {type(e).__name__}: {str(e)[:200]}")

    print()
    print("TFLOP/s (bf16 forward+backward, 3.5x forward FLOPs, device time)")
    print(f"{'D':>4} {'S':>6} {'causal':>6} " + " ".join(f"{n:>12}" for n in impls))
    for d, s, c in sorted({k[:3] for k in table}):
        print(f"{d:>4} {s:>6} {c:>6} " + " ".join(f"{table.get((d, s, c, n), '-'):>12}" for n in impls))


if __name__ == "__main__":
    main()
