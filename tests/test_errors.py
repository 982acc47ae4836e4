"""One case per validation branch of jaxflash.attention: the exception type and a message naming the
argument and the value received. Also the FFI handlers' own checks (the backstop)."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxflash
from jaxflash import _ffi

attention_module = importlib.import_module("jaxflash.attention")  # the attribute jaxflash.attention is the function


def arr(*shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


Q, K = arr(2, 8, 4, 16), arr(2, 8, 2, 16)

CASES = [
    ("not an array", ([[1.0]], K, K), {}, TypeError, r"query must be an array; got list"),
    ("rank", (arr(8, 16), K, K), {}, ValueError, r"query must have rank >= 3 .*got shape \(8, 16\)"),
    ("ranks differ", (arr(1, 2, 8, 4, 16), K, K), {}, ValueError, r"same rank; got query \(1, 2, 8, 4, 16\)"),
    ("leading dims", (Q, arr(3, 8, 2, 16), arr(3, 8, 2, 16)), {}, ValueError, r"share leading .*key \(3, 8, 2, 16\)"),
    ("k/v shapes", (Q, K, arr(2, 9, 2, 16)), {}, ValueError, r"key and value must have the same shape; got key "
                                                               r"\(2, 8, 2, 16\), value \(2, 9, 2, 16\)"),
    ("head dims", (Q, arr(2, 8, 2, 32), arr(2, 8, 2, 32)), {}, ValueError, r"same head dim; got query 16, key 32"),
    ("head dim 0", (arr(2, 8, 4, 0), arr(2, 8, 2, 0), arr(2, 8, 2, 0)), {}, ValueError, r"head dim .*got 0"),
    ("head dim 320", (arr(2, 8, 4, 320), arr(2, 8, 2, 320), arr(2, 8, 2, 320)), {}, ValueError,
     r"head dim must be in \[1, 256\]; got 320"),
    ("heads", (Q, arr(2, 8, 3, 16), arr(2, 8, 3, 16)), {}, ValueError, r"multiple of key/value heads; got 4 .* 3"),
    ("dtypes differ", (Q, arr(2, 8, 2, 16, dtype=jnp.bfloat16), K), {}, TypeError,
     r"share a dtype; got query=float32, key=bfloat16"),
    ("integer dtype", (arr(2, 8, 4, 16, dtype=jnp.int32), arr(2, 8, 2, 16, dtype=jnp.int32),
                       arr(2, 8, 2, 16, dtype=jnp.int32)), {}, TypeError, r"float32, bfloat16 or float16; got int32"),
    ("scale zero", (Q, K, K), {"scale": 0.0}, ValueError, r"scale must be finite and positive; got 0.0"),
    ("scale negative", (Q, K, K), {"scale": -1.0}, ValueError, r"finite and positive; got -1.0"),
    ("scale nan", (Q, K, K), {"scale": float("nan")}, ValueError, r"finite and positive; got nan"),
    ("scale inf", (Q, K, K), {"scale": float("inf")}, ValueError, r"finite and positive; got inf"),
    ("scale string", (Q, K, K), {"scale": "big"}, TypeError, r"scale must be a number; got 'big'"),
    ("causal not bool", (Q, K, K), {"causal": 1}, TypeError, r"causal must be a Python bool; got 1"),
    ("return_lse not bool", (Q, K, K), {"return_lse": "yes"}, TypeError, r"return_lse must be a Python bool"),
    ("deterministic not bool", (Q, K, K), {"deterministic": None}, TypeError,
     r"deterministic must be a Python bool; got None"),
    ("window not a pair", (Q, K, K), {"window": 3}, ValueError, r"window must be a pair \(left, right\); got 3"),
    ("window side float", (Q, K, K), {"window": (1.5, 0)}, TypeError, r"window left side must be an int or None; "
                                                                       r"got 1.5"),
    ("window side -2", (Q, K, K), {"window": (4, -2)}, ValueError, r"window right side must be >= -1 .*got -2"),
    ("softcap zero", (Q, K, K), {"softcap": 0.0}, ValueError, r"softcap must be finite and positive .*got 0.0"),
    ("softcap negative", (Q, K, K), {"softcap": -3}, ValueError, r"softcap must be finite and positive .*got -3"),
    ("softcap string", (Q, K, K), {"softcap": "x"}, TypeError, r"softcap must be a number; got 'x'"),
    ("softcap too large", (Q, K, K), {"softcap": 1e38}, ValueError,
     r"softcap is too large for the scale: .*got softcap=1e\+38, scale=0.25"),
    ("softcap too large for a small scale", (Q, K, K), {"softcap": 1e20, "scale": 1e-20}, ValueError,
     r"softcap is too large for the scale: .*got softcap=1e\+20, scale=1e-20"),
    ("only q segment ids", (Q, K, K), {"q_segment_ids": jnp.zeros((2, 8), jnp.int32)}, ValueError,
     r"given together; got only q_segment_ids"),
    ("only kv segment ids", (Q, K, K), {"kv_segment_ids": jnp.zeros((2, 8), jnp.int32)}, ValueError,
     r"given together; got only kv_segment_ids"),
    ("segment ids shape", (Q, K, K), {"q_segment_ids": jnp.zeros((2, 7), jnp.int32),
                                      "kv_segment_ids": jnp.zeros((2, 8), jnp.int32)}, ValueError,
     r"q_segment_ids must have shape \(2, 8\); got \(2, 7\)"),
    ("segment ids dtype", (Q, K, K), {"q_segment_ids": jnp.zeros((2, 8)), "kv_segment_ids": jnp.zeros((2, 8))},
     TypeError, r"q_segment_ids must have an integer dtype; got float32"),
    ("lengths shape", (Q, K, K), {"kv_lengths": jnp.zeros((2, 1), jnp.int32)}, ValueError,
     r"kv_lengths must have shape \(2,\); got \(2, 1\)"),
    ("negative lengths", (Q, K, K), {"q_lengths": jnp.array([3, -1], jnp.int32)}, ValueError,
     r"q_lengths must be >= 0; got -1"),
    ("dropout rate 1", (Q, K, K), {"dropout_rate": 1.0, "dropout_key": jax.random.key(0)}, ValueError,
     r"dropout_rate must be in \[0, 1\); got 1.0"),
    ("dropout rate negative", (Q, K, K), {"dropout_rate": -0.1}, ValueError, r"dropout_rate must be in \[0, 1\)"),
    ("dropout rate string", (Q, K, K), {"dropout_rate": "x"}, TypeError, r"dropout_rate must be a number; got 'x'"),
    ("dropout without key", (Q, K, K), {"dropout_rate": 0.1}, ValueError, r"dropout_rate=0.1 needs a dropout_key"),
    ("dropout bad key", (Q, K, K), {"dropout_rate": 0.1, "dropout_key": jnp.zeros((3,), jnp.uint32)}, ValueError,
     r"dropout_key must be a JAX PRNG key with two 32-bit words.*shape \(3,\)"),
    ("backend", (Q, K, K), {"backend": "tpu"}, ValueError, r"backend must be one of .*got 'tpu'"),
]


@pytest.mark.parametrize("args,kwargs,exc,match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_validation(args, kwargs, exc, match):
    with pytest.raises(exc, match=r"^jaxflash\.attention: .*" + match):
        jaxflash.attention(*args, **kwargs)


def test_traced_scale_is_rejected():
    with pytest.raises(TypeError, match="scale must be a static Python number"):
        jax.jit(lambda s: jaxflash.attention(Q, K, K, scale=s))(0.5)


def test_traced_dropout_rate_is_rejected():
    with pytest.raises(TypeError, match="dropout_rate must be a static Python number"):
        jax.jit(lambda r: jaxflash.attention(Q, K, K, dropout_rate=r, dropout_key=jax.random.key(0)))(0.5)


def test_cuda_backend_without_gpu():
    if _ffi.cuda_built():
        match = "needs the inputs on a GPU"
        exc = ValueError
    else:
        match, exc = "built without its CUDA module", RuntimeError
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("this machine has a GPU")
    with pytest.raises(exc, match=match):
        jaxflash.attention(Q, K, K, backend="cuda")


def pretend_cuda(monkeypatch, fwd, bwd):
    """Inputs on a GPU and a CUDA module compiled for `fwd` and `bwd` ((dtype, head dim) sets): enough to trace."""
    monkeypatch.setattr(attention_module, "_platform", lambda x: "gpu")
    monkeypatch.setattr(_ffi, "cuda_built", lambda: True)
    monkeypatch.setattr(_ffi, "cuda_supported", lambda pass_="fwd": {"fwd": fwd, "bwd": bwd}[pass_])


@pytest.mark.parametrize("backend", [None, "cuda"])
def test_cuda_backward_not_compiled_is_refused_when_differentiated(monkeypatch, backend):
    pretend_cuda(monkeypatch, fwd={("float16", 16), ("bfloat16", 16)},
                 bwd={("bfloat16", 16), ("bfloat16", 64), ("float16", 64)})
    q, k = arr(2, 8, 4, 16, dtype=jnp.float16), arr(2, 8, 2, 16, dtype=jnp.float16)
    f = lambda q: jaxflash.attention(q, k, k, backend=backend)
    jax.make_jaxpr(f)(q)  # the forward alone is compiled: it passes
    match = (r"^jaxflash\.attention: the CUDA backward pass is not compiled for float16 with head dim 16, only the "
             r"forward; the backward is compiled for bfloat16 with head dims \[16, 64\]; float16 with head dims \[64\]")
    with pytest.raises(NotImplementedError, match=match):
        jax.make_jaxpr(jax.grad(lambda q: f(q).sum()))(q)
    with pytest.raises(NotImplementedError, match=match):
        jax.make_jaxpr(lambda q: jax.vjp(f, q))(q)
    qb, kb = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)  # compiled for both passes
    jax.make_jaxpr(jax.grad(lambda q: jaxflash.attention(q, kb, kb, backend=backend).sum()))(qb)


def test_cuda_forward_not_compiled_is_refused(monkeypatch):
    pretend_cuda(monkeypatch, fwd={("bfloat16", 64)}, bwd={("float16", 16)})
    q, k = arr(2, 8, 4, 16, dtype=jnp.float16), arr(2, 8, 2, 16, dtype=jnp.float16)
    with pytest.raises(NotImplementedError, match=r"supports bfloat16 with head dims \[64\]; got "
                                                  r"float16 with head dim 16"):
        jax.eval_shape(lambda q: jaxflash.attention(q, k, k, backend="cuda"), q)


def test_errors_raise_at_trace_time_under_jit():
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        jax.jit(lambda q, k: jaxflash.attention(q, k, k)).lower(Q, arr(2, 8, 3, 16))


# The handlers re-check what the Python layer already checked: a direct FFI call with bad shapes or
# attributes must come back as an error, never a crash.
def raw_fwd(q, k, v, *, seg=None, lens=None, state=None, **attrs):
    lead = q.shape[:-3] if q.ndim >= 3 else ()
    sq = q.shape[-3] if q.ndim >= 3 else 1
    sk = k.shape[-3] if k.ndim >= 3 else 1
    seg = seg or (jnp.zeros(lead + (sq,), jnp.int32), jnp.zeros(lead + (sk,), jnp.int32))
    lens = lens or (jnp.zeros(lead, jnp.int32), jnp.zeros(lead, jnp.int32))
    state = jnp.zeros(lead + (5,), jnp.uint32) if state is None else state
    out_types = (jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct(lead + (q.shape[-2], sq) if q.ndim >= 3 else (1,), jnp.float32))
    kw = dict(scale=np.float32(1.0), softcap=np.float32(0.0), window_left=-1, window_right=-1, bottom_right=True,
              diagonal_shift=0, segment_ids=False, lengths=False, dropout_rate=np.float32(0), deterministic=False)
    kw.update(attrs)
    return jax.block_until_ready(jax.ffi.ffi_call("jaxflash_fwd", out_types)(q, k, v, *seg, *lens, state, **kw))


@pytest.mark.parametrize("q,k,v,kwargs,match", [
    (arr(2, 8, 4, 16), arr(2, 8, 3, 16), arr(2, 8, 3, 16), {}, "query heads must be a multiple"),
    (arr(2, 8, 4, 300), arr(2, 8, 4, 300), arr(2, 8, 4, 300), {}, r"head dim must be in \[1, 256\]; got 300"),
    (arr(2, 8, 4, 16), arr(3, 8, 4, 16), arr(3, 8, 4, 16), {}, "share leading dims"),
    (arr(8, 16), arr(8, 16), arr(8, 16), {}, "rank >= 3"),
    (arr(2, 8, 4, 16, dtype=jnp.int32),) * 3 + ({}, "dtype must be float32, bfloat16 or float16"),
    (Q, K, K, {"window_left": -2}, r"window sides must be >= -1; got \(-2, -1\)"),
    (Q, K, K, {"softcap": np.float32(-1)}, "softcap must be finite and >= 0"),
    (Q, K, K, {"softcap": np.float32(1e38)}, r"softcap is too large for the scale: .*got softcap 1e\+38"),
    (Q, K, K, {"seg": (jnp.zeros((2, 7), jnp.int32), jnp.zeros((2, 8), jnp.int32)), "segment_ids": True},
     r"q_segment_ids must have shape \[2, 8\]; got \[2, 7\]"),
    (Q, K, K, {"lens": (jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.int32)), "lengths": True},
     r"q_lengths must have shape \[2\]; got \[3\]"),
    (Q, K, K, {"dropout_rate": np.float32(1.5)}, r"dropout_rate must be in \[0, 1\); got 1.5"),
    (Q, K, K, {"state": jnp.zeros((2, 2), jnp.uint32), "dropout_rate": np.float32(0.1)},
     r"dropout_state must have shape \[2, 5\]; got \[2, 2\]"),
])
def test_handler_rejects_bad_input(q, k, v, kwargs, match):
    with pytest.raises(Exception, match="jaxflash_fwd: .*" + match):
        raw_fwd(q, k, v, **kwargs)


@pytest.mark.parametrize("sq,rows,want", [(8, 8, 129), (8, 128, 129), (1000, 1040, 1041), (4096, 4160, 4162)])
def test_backward_handler_checks_the_dq_workspace(sq, rows, want):
    """dq_accum's rows are Sq rounded up to whole query tiles of 64, 80 and 128 rows (the Hopper kernels add whole
    tiles; 1000 rows need 13 tiles of 80, more than 8 of 128), then a row per 2048 for the tiles' flags (4096 rows:
    52 tiles of 80, then 2)."""
    lead = (2,)
    q, k = arr(2, sq, 4, 16), arr(2, sq, 2, 16)
    assert _ffi._dq_accum_type(q).shape == (2, want, 4, 16)
    stat = jnp.zeros((2, 4, sq), jnp.float32)
    seg = (jnp.zeros(lead + (sq,), jnp.int32),) * 2
    lens = (jnp.zeros(lead, jnp.int32),) * 2
    out_types = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct((2, rows, 4, 16), jnp.float32),
                 jax.ShapeDtypeStruct(stat.shape, jnp.float32))
    kw = dict(scale=np.float32(1.0), softcap=np.float32(0.0), window_left=-1, window_right=-1, bottom_right=True,
              diagonal_shift=0, segment_ids=False, lengths=False, dropout_rate=np.float32(0), deterministic=False)
    with pytest.raises(Exception, match=rf"jaxflash_bwd: dq_accum must have shape \[2, {want}, 4, 16\]; got "
                                        rf"\[2, {rows}, 4, 16\]"):
        jax.block_until_ready(jax.ffi.ffi_call("jaxflash_bwd", out_types)(
            q, q, k, k, q, stat, stat, *seg, *lens, jnp.zeros(lead + (5,), jnp.uint32), **kw))


def test_module_built_for_a_newer_jax_is_refused_with_the_remedy():
    _ffi.check_ffi_api("m", (0, 3), (0, 5))  # built against an older FFI API: loads
    _ffi.check_ffi_api("m", (0, 5), None)  # the running API unknown: not refused
    with pytest.raises(ImportError, match=r"m was built against XLA FFI API 0\.5, newer than the 0\.4 .*"
                                          r"--no-build-isolation"):
        _ffi.check_ffi_api("m", (0, 5), (0, 4))


def test_installed_modules_speak_the_running_jax_ffi_api():
    running = _ffi.running_ffi_api()
    assert running is not None and running >= (0, 1)  # jaxlib ships the headers it was built with
    for module in (_ffi._jaxflash_cpu, _ffi._jaxflash_cuda):
        if module is not None:
            assert tuple(module.ffi_api_version()) <= running
