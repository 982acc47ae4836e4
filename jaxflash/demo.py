"""`python -m jaxflash.demo`: train a small character-level GPT twice, with jaxflash and with standard attention.

The model (flax.linen) calls `jaxflash.attention(q, k, v, causal=True)` in every block; the second run swaps in
standard attention, `jax.nn.dot_product_attention(..., is_causal=True, implementation="xla")` (it materialises
the scores and computes the softmax in float32), and starts from the same initial weights with the same
batches. The text is an excerpt of Shakespeare's Coriolanus shipped in jaxflash/data/ (public domain; see the
README there). Prints the two loss curves side by side (the mean loss of each window of --every steps),
tokens/s and peak memory (XLA's buffer assignment of the compiled train step), and exits 1 if the window
means differ by more than the tolerance.
The defaults run in about a minute on a CPU; `--large` is a GPU-sized model (bf16 attention inputs).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash
from jaxflash.bench import peak_mb

try:
    import flax.linen as nn
    import optax
except ImportError as e:  # pragma: no cover
    raise SystemExit(f"jaxflash.demo needs flax (pip install flax): {e}") from e


def flash(q, k, v):
    return jaxflash.attention(q, k, v, causal=True)


def standard(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


class Block(nn.Module):
    heads: int
    attention: Callable
    dtype: Any

    @nn.compact
    def __call__(self, x):
        b, s, w = x.shape
        qkv = nn.Dense(3 * w, use_bias=False)(nn.LayerNorm()(x)).reshape(b, s, 3, self.heads, w // self.heads)
        q, k, v = (qkv[:, :, i].astype(self.dtype) for i in range(3))  # [B, S, H, D], as jaxflash takes them
        x = x + nn.Dense(w)(self.attention(q, k, v).astype(x.dtype).reshape(b, s, w))
        return x + nn.Dense(w)(nn.gelu(nn.Dense(4 * w)(nn.LayerNorm()(x))))


class GPT(nn.Module):
    vocab: int
    width: int
    heads: int
    layers: int
    seq: int
    attention: Callable
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        pos = self.param("pos", nn.initializers.normal(0.02), (self.seq, self.width))
        x = nn.Embed(self.vocab, self.width)(tokens) + pos[: tokens.shape[1]]
        for _ in range(self.layers):
            x = Block(self.heads, self.attention, self.dtype)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


@dataclasses.dataclass
class Config:
    width: int = 128
    heads: int = 4
    layers: int = 2
    seq: int = 128
    batch: int = 16
    steps: int = 300
    lr: float = 3e-3
    dtype: str = "float32"
    seed: int = 0


LARGE = dict(width=512, heads=8, layers=6, seq=512, batch=32, steps=500, lr=1e-3, dtype="bfloat16")


def load_text():
    return (importlib.resources.files("jaxflash") / "data" / "coriolanus.txt").read_text(encoding="utf-8")


def batches(data, cfg):
    """The same random windows for both runs: (inputs, next-character targets) per step."""
    rng = np.random.default_rng(cfg.seed)
    for _ in range(cfg.steps):
        starts = rng.integers(0, len(data) - cfg.seq - 1, cfg.batch)
        window = np.stack([data[s:s + cfg.seq + 1] for s in starts])
        yield window[:, :-1], window[:, 1:]


def train(cfg, attention, params, data, vocab):
    """Losses per step, tokens/s (after the compiling first step) and the train step's peak MB."""
    model = GPT(vocab, cfg.width, cfg.heads, cfg.layers, cfg.seq, attention, jnp.dtype(cfg.dtype))
    opt = optax.adamw(cfg.lr)

    @jax.jit
    def step(params, opt_state, x, y):
        def loss_fn(p):
            logits = model.apply(p, x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = opt.init(params)
    losses, mem, t0 = [], None, None
    for i, (x, y) in enumerate(batches(data, cfg)):
        if mem is None:
            mem = peak_mb(step, (params, opt_state, x, y))
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(loss)
        if i == 0:
            jax.block_until_ready(loss)
            t0 = time.perf_counter()
    jax.block_until_ready(losses[-1])
    tokens_per_s = (cfg.steps - 1) * cfg.batch * cfg.seq / max(time.perf_counter() - t0, 1e-9)
    return np.asarray(jax.device_get(losses), np.float64), tokens_per_s, mem


def run(cfg, every=25, out=print):
    """Both trainings; returns (flash losses, standard losses, max relative difference of the means over
    windows of `every` steps, tolerance)."""
    text = load_text()
    chars = sorted(set(text))
    data = np.array([chars.index(c) for c in text], np.int32)
    init_model = GPT(len(chars), cfg.width, cfg.heads, cfg.layers, cfg.seq, standard, jnp.dtype(cfg.dtype))
    params = init_model.init(jax.random.key(cfg.seed), np.zeros((1, cfg.seq), np.int32))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    out(f"jaxflash.demo: char-level GPT on Coriolanus ({len(text):,} chars, {len(chars)} symbols), {n_params:,} "
        f"parameters: {cfg.layers} layers, width {cfg.width}, {cfg.heads} heads (D={cfg.width // cfg.heads}), seq "
        f"{cfg.seq}, batch {cfg.batch}, {cfg.steps} steps, attention in {cfg.dtype}, on {jax.devices()[0].device_kind}")
    runs = {name: train(cfg, fn, params, data, len(chars)) for name, fn in (("jaxflash", flash),
                                                                           ("standard", standard))}
    (lf, tf, mf), (ls, ts, ms) = runs["jaxflash"], runs["standard"]
    # Curves are compared as means over windows of `every` steps: the two attentions agree to ~1e-7 (float32)
    # per call, but training amplifies any difference step by step, and in bfloat16 (p rounded differently by
    # the two) single steps of the two runs drift apart by a few percent within a few hundred steps.
    tol = 1e-2 if cfg.dtype == "float32" else 5e-2
    starts = list(range(0, cfg.steps, every))
    wf, ws = (np.array([x[i:i + every].mean() for i in starts]) for x in (lf, ls))
    diff = np.abs(wf - ws) / np.abs(ws)
    out(f"\n{'steps':>11}{'jaxflash':>11}{'standard':>11}{'rel diff':>10}   (mean loss per window)")
    for i, a, b, d in zip(starts, wf, ws, diff):
        out(f"{f'{i}-{min(i + every, cfg.steps) - 1}':>11}{a:11.4f}{b:11.4f}{d:10.1e}")
    out(f"\n{'':24}{'jaxflash':>12}{'standard':>12}")
    out(f"{'tokens/s':24}{tf:12,.0f}{ts:12,.0f}")
    out(f"{'peak MB (train step)':24}{mf:12.1f}{ms:12.1f}")
    verdict = "equal within tolerance" if diff.max() <= tol else "DIFFERENT"
    out(f"\nloss curves: max relative difference of the window means {diff.max():.1e} (tolerance {tol:g}); "
        f"single steps {np.max(np.abs(lf - ls) / np.abs(ls)):.1e}: {verdict}")
    return lf, ls, float(diff.max()), tol


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m jaxflash.demo", description=__doc__.splitlines()[0])
    p.add_argument("--large", action="store_true", help=f"a GPU-sized run: {LARGE}")
    for f in dataclasses.fields(Config):
        p.add_argument(f"--{f.name}", type=type(f.default) if f.name != "dtype" else str, default=None)
    p.add_argument("--every", type=int, default=25, help="steps per printed (and compared) window")
    args = p.parse_args(argv)
    if args.every < 1:
        p.error(f"--every must be >= 1; got {args.every}")
    cfg = Config(**(LARGE if args.large else {}))
    for f in dataclasses.fields(Config):
        if getattr(args, f.name) is not None:
            setattr(cfg, f.name, getattr(args, f.name))
    _, _, diff, tol = run(cfg, args.every)
    return 0 if diff <= tol else 1


if __name__ == "__main__":
    sys.exit(main())
