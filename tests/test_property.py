"""Property test: random shapes, flags and dtypes against the float64 oracle, forward and backward."""
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

import jaxflash
import oracle
from conftest import DTYPES, check_close, kernel_grads, make_inputs, naive_forward, naive_grads


@st.composite
def configs(draw):
    hk = draw(st.integers(1, 3))
    return dict(
        lead=tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))),
        sq=draw(st.integers(1, 70)), sk=draw(st.integers(1, 70)),
        hq=hk * draw(st.integers(1, 3)), hk=hk, d=draw(st.integers(1, 72)),
        causal=draw(st.booleans()), dtype=draw(st.sampled_from(sorted(DTYPES))),
        scale=draw(st.one_of(st.none(), st.floats(0.01, 2.0))), seed=draw(st.integers(0, 2**31)))


# derandomize: the same 40 examples in every run, so a failure replays (like the other tests' stable seeds);
# no example database, so one machine's stored failures do not make its runs differ from CI's.
@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(configs())
def test_random_configs_match_oracle(c):
    q, k, v, do = make_inputs(c["seed"], c["lead"], c["sq"], c["sk"], c["hq"], c["hk"], c["d"], DTYPES[c["dtype"]])
    case = str(c)
    out, lse = jaxflash.attention(q, k, v, causal=c["causal"], scale=c["scale"], return_lse=True)
    grads = kernel_grads(q, k, v, do, c["causal"], c["scale"])
    as64 = [np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v, do)]
    ro, rl, *rg = oracle.attention(*as64[:3], causal=c["causal"], scale=c["scale"], do=as64[3])
    no, nl = naive_forward(q, k, v, c["causal"], c["scale"])
    ng = naive_grads(q, k, v, do, c["causal"], c["scale"])
    check_close("o", out, ro, no, c["dtype"], case)
    check_close("lse", lse, rl, nl, c["dtype"], case)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, rg, ng):
        check_close(name, g, r, n, c["dtype"], case)
