"""The shape grid of the kernel tests (shared by the CPU tests and the GPU check)."""
import itertools

SEQS = (1, 17, 113, 255, 1000)
HEAD_DIMS = (16, 32, 40, 64, 96, 128, 256)
HEADS = ((4, 4), (8, 2), (8, 1))
DTYPES = ("float32", "bfloat16", "float16")


def cases():
    """Every (Sq, Sk) pair (Sq != Sk both ways) x causal, with head dim, heads and dtype rotated so each
    value of each axis appears many times; plus every head dim x dtype x causal at one odd shape."""
    out = []
    for n, ((sq, sk), causal) in enumerate(itertools.product(itertools.product(SEQS, SEQS), (False, True))):
        d = HEAD_DIMS[n % len(HEAD_DIMS)]
        if sq * sk >= 255 * 1000:
            d = min(d, 64)  # keep the float64 oracle and the CI time in bounds on the largest shapes
        out.append((sq, sk, *HEADS[n % len(HEADS)], d, causal, DTYPES[(n // 2) % len(DTYPES)]))
    for d, dtype, causal in itertools.product(HEAD_DIMS, DTYPES, (False, True)):
        out.append((113, 255, 8, 2, d, causal, dtype))
    return out


def case_id(c):
    sq, sk, hq, hk, d, causal, dtype = c
    return f"q{sq}-k{sk}-h{hq}x{hk}-d{d}-{'causal' if causal else 'full'}-{dtype}"
