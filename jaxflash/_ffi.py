"""FFI target registration and the calls: `fwd` (the decode kernel for few query rows on the GPU), `bwd`,
`paged_fwd`. No validation and no defaults here: `attention.py` and `paged.py` own the contract; the C++
handlers re-check as a backstop."""
from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from . import _jaxflash_cpu

try:  # Built only where nvcc was found; with static cudart it imports on machines without a GPU.
    from . import _jaxflash_cuda
except ImportError:
    _jaxflash_cuda = None


def running_ffi_api():
    """(major, minor) of the XLA FFI API the running jaxlib speaks, read from the headers it ships; None if
    they cannot be read."""
    try:
        with open(os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")) as f:
            text = f.read()
        return tuple(int(re.search(rf"#define XLA_FFI_API_{part}\s+(\d+)", text).group(1))
                     for part in ("MAJOR", "MINOR"))
    except (AttributeError, OSError, ValueError):
        return None


def check_ffi_api(module: str, built, running) -> None:
    """A handler built against a newer FFI API than the running jax's fails at registration, and then every
    JAX backend fails to initialise (older ones load); refuse to load such a module, with the remedy."""
    if running is None or tuple(built) <= tuple(running):
        return
    raise ImportError(
        f"jaxflash: {module} was built against XLA FFI API {built[0]}.{built[1]}, newer than the "
        f"{running[0]}.{running[1]} of the running jax {jax.__version__} (an isolated build can pick a newer jax "
        f"than the one installed); rebuild it against this jax (build dependencies installed) with "
        f"`pip install --no-build-isolation --force-reinstall --no-deps .`, or upgrade jax")


for _module in (_jaxflash_cpu, _jaxflash_cuda):
    if _module is not None and hasattr(_module, "ffi_api_version"):
        check_ffi_api(_module.__name__, tuple(_module.ffi_api_version()), running_ffi_api())

for _name, _capsule in _jaxflash_cpu.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
if _jaxflash_cuda is not None:
    for _name, _capsule in _jaxflash_cuda.registrations().items():
        # Exactly "CUDA": registration is case-sensitive and "cuda" silently never matches.
        jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


def cuda_built() -> bool:
    return _jaxflash_cuda is not None


def _typeof(x):
    return jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)


def _stat_type(q):
    """Type of a per-row statistic `[..., H, Sq]` float32 built from q's type, so that shard_map's
    manual-axis info and an Explicit mesh's sharding carry over (a fresh ShapeDtypeStruct would drop both)."""
    t = _typeof(q)
    shape = q.shape[:-3] + (q.shape[-2], q.shape[-3])
    sharding = getattr(t, "sharding", None)
    spec = tuple(getattr(sharding, "spec", ()) or ())
    if len(spec) == q.ndim and any(s is not None for s in spec):
        new_spec = P(*spec[:-3], spec[-2], spec[-3])
        return t.update(shape=shape, dtype=jnp.float32, sharding=sharding.update(spec=new_spec))
    return t.update(shape=shape, dtype=jnp.float32)


# dq_accum's rows: Sq rounded up to a whole number of query tiles of every Hopper backward kernel (64, 80 and 128
# rows), so that those kernels add whole tiles of dQ, and one more per 2048 rows for their per-tile flags
# (cuda/common/params.h, dq_accum_rows).
def _dq_accum_rows(sq: int) -> int:
    return max(-(-sq // 128) * 128, -(-sq // 80) * 80) + -(-sq // 2048)


def _dq_accum_type(q):
    """The backward's fp32 dQ workspace: q's shape with Sq rounded up, q's sharding."""
    t = _typeof(q)
    sq = q.shape[-3]
    rows = _dq_accum_rows(sq)
    return t.update(shape=(*q.shape[:-3], rows, *q.shape[-2:]), dtype=jnp.float32)


def _attrs(cfg) -> dict:
    """The FFI attributes of a `_vjp.Config`: exactly the fields of the handlers' `Options` struct, which both
    targets decode whole (np.float32 for a float field: a Python float is f64)."""
    return dict(scale=np.float32(cfg.scale), softcap=np.float32(cfg.softcap), window_left=int(cfg.window_left),
                window_right=int(cfg.window_right), bottom_right=bool(cfg.bottom_right),
                diagonal_shift=int(cfg.diagonal_shift),
                segment_ids=bool(cfg.segment_ids), lengths=bool(cfg.lengths),
                dropout_rate=np.float32(cfg.dropout_rate), deterministic=bool(cfg.deterministic))


def fwd(q, k, v, operands, cfg):
    """(q, k, v, (q_segment_ids, kv_segment_ids, q_lengths, kv_lengths, dropout_state)) -> (o, lse). The CUDA
    target also returns the split-KV workspaces of its decode kernel (few query rows per K/V head), sized here
    from the module's split count for the shape."""
    if cfg.backend != "cuda":
        call = jax.ffi.ffi_call("jaxflash_fwd", (_typeof(q), _stat_type(q)), vmap_method="broadcast_all")
        return call(q, k, v, *operands, **_attrs(cfg))
    n = 0 if cfg.dropout_rate > 0 else _splits(q, k.shape[-3], k.shape[-2])
    scratch = _split_tile_floats(q, k, cfg) if n == 0 else 0
    call = jax.ffi.ffi_call("jaxflash_fwd", (_typeof(q), _stat_type(q), *_workspaces(q, n, scratch)),
                            vmap_method="broadcast_all")
    return tuple(call(q, k, v, *operands, **_attrs(cfg))[:2])


MAX_SPLITS = 64  # the decode kernel's limit (kMaxSplits)


def _splits(q, seqlen_k, heads_k, num_splits=None) -> int:
    """Key splits of the decode kernel for q [..., Sq, Hq, D] against seqlen_k keys: `num_splits` when given,
    else the module's heuristic for the GPU (0 when the decode kernel does not take the shape). Static per
    shape: decided at trace time, no device sync."""
    if num_splits is not None:
        return int(num_splits)
    if _jaxflash_cuda is None:  # tracing for CUDA without the module (tests that pretend)
        return 0
    batch = int(np.prod(q.shape[:-3], dtype=np.int64))
    return int(_jaxflash_cuda.decode_num_splits(batch, q.shape[-3], q.shape[-2], heads_k, seqlen_k, q.shape[-1]))


def _split_tile_floats(q, k, cfg) -> int:
    """Floats of scratch the sm90 forward may use to share its last tiles between all SMs: only when every tile
    costs the same (no window, causal mask, segment ids or lengths); 0 otherwise or without a GPU to ask."""
    if (_jaxflash_cuda is None or not hasattr(_jaxflash_cuda, "fwd_split_floats") or cfg.window_left >= 0
            or cfg.window_right >= 0 or cfg.segment_ids or cfg.lengths):
        return 0
    batch = int(np.prod(q.shape[:-3], dtype=np.int64))
    return int(_jaxflash_cuda.fwd_split_floats(batch, q.shape[-3], q.shape[-2], k.shape[-3], q.shape[-1]))


def _workspaces(q, n, scratch=0):
    """Types of the decode kernel's fp32 split workspaces, [n, *q.shape] and [n, *lse.shape]; n = 0 when the
    keys are not split (the kernel then writes o and lse directly). Unsplit, the second may hold `scratch`
    floats for the sm90 forward instead, as [m, *lse.shape] (rounded up to whole lse shapes)."""
    n = n if n > 1 else 0
    lse_size = int(np.prod(_stat_type(q).shape, dtype=np.int64))
    m = n if n or not scratch or not lse_size else -(-scratch // lse_size)
    out = []
    for t, lead in ((_typeof(q), n), (_stat_type(q), m)):
        sharding = getattr(t, "sharding", None)
        spec = tuple(getattr(sharding, "spec", ()) or ())
        if len(spec) == len(t.shape) and any(x is not None for x in spec):
            out.append(t.update(shape=(lead, *t.shape), dtype=jnp.float32,
                                sharding=sharding.update(spec=P(None, *spec))))
        else:
            out.append(t.update(shape=(lead, *t.shape), dtype=jnp.float32))
    return out


def paged_fwd(query, key_cache, value_cache, block_tables, kv_lengths, opts, backend, num_splits=None):
    """The jaxflash_paged_fwd call: (o [B, Sq, Hq, D], lse [B, Hq, Sq]). opts = (scale, softcap, window_left,
    window_right). The CUDA kernel splits the keys (split-KV); the CPU one never does."""
    scale, softcap, left, right = opts
    attrs = dict(scale=np.float32(scale), softcap=np.float32(softcap), window_left=np.int64(left),
                 window_right=np.int64(right))
    lse_type = jax.ShapeDtypeStruct((query.shape[0], query.shape[2], query.shape[1]), jnp.float32)
    types = (jax.ShapeDtypeStruct(query.shape, query.dtype), lse_type)
    if backend == "cuda":
        capacity = block_tables.shape[1] * key_cache.shape[1]
        n = _splits(query, capacity, key_cache.shape[2], num_splits)
        n = n if n > 1 else 0
        types += (jax.ShapeDtypeStruct((n, *query.shape), jnp.float32),
                  jax.ShapeDtypeStruct((n, *lse_type.shape), jnp.float32))
    call = jax.ffi.ffi_call("jaxflash_paged_fwd", types, vmap_method="sequential")
    return tuple(call(query, key_cache, value_cache, block_tables, kv_lengths, **attrs)[:2])


def bwd(do, q, k, v, o, lse, dlse, operands, cfg):
    """(do, q, k, v, o, lse, dlse, the operands of fwd) -> (dq, dk, dv, dq accumulator, rowsum(dO * O) - dlse);
    dlse is the cotangent of lse. The last two are the kernel's fp32 workspaces, outputs owned by XLA, returned
    so that the partitioning rule can name every result (callers keep the first three)."""
    out_types = (_typeof(q), _typeof(k), _typeof(v), _dq_accum_type(q), _stat_type(q))
    call = jax.ffi.ffi_call("jaxflash_bwd", out_types, vmap_method="broadcast_all")
    return tuple(call(do, q, k, v, o, lse, dlse, *operands, **_attrs(cfg)))


def cuda_configs() -> list[tuple[str, str, str, int]]:
    """(family, pass, dtype name, head dim) of every configuration compiled into the CUDA module, in the order
    of its configuration list; empty without the module. Families: "sm80" (every GPU from sm_80 on), "sm90"
    (Hopper) and "decode" (split-KV for few query rows and paged caches, every GPU); passes: "fwd", "bwd"."""
    if _jaxflash_cuda is None:
        return []
    return [(str(f), str(p), str(t), int(d)) for f, p, t, d in _jaxflash_cuda.supported_configs()]


def describe_configs(pairs) -> str:
    """(dtype name, head dim) pairs as text, e.g. "bfloat16 with head dims [64, 128]; float16 with head dims [64]"."""
    return "; ".join(f"{t} with head dims {sorted(d for u, d in pairs if u == t)}"
                     for t in sorted({t for t, _ in pairs})) or "nothing"


def cuda_supported(pass_: str = "fwd") -> set[tuple[str, int]]:
    """(dtype name, head dim) pairs the CUDA module runs for `pass_` ("fwd" or "bwd") on some family."""
    return {(t, d) for _, p, t, d in cuda_configs() if p == pass_}
