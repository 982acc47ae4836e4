"""`python -m jaxflash.demo`: train a small character-level GPT twice, with jaxflash and with standard attention.

The model (flax.linen) calls `jaxflash.attention(q, k, v, causal=True)` in every block; the second run swaps in
standard attention, `jax.nn.dot_product_attention(..., is_causal=True, implementation="xla")` (it materialises
the scores and computes the softmax in float32), and starts from the same initial weights with the same
batches. The text is an excerpt of Shakespeare's Coriolanus shipped in jaxflash/data/ (public domain; see the
README there). Prints the two loss curves side by side (the mean loss of each window of --every steps),
tokens/s and peak memory (XLA's buffer assignment of the compiled train step), and exits 1 if the window
means differ by more than the tolerance.
The defaults run in about a minute on a CPU; `--large` is a GPU-sized model (bf16 attention inputs).

`--generate` trains the jaxflash model alone, then continues a few prompts from the text greedily, twice: with a
paged KV cache (`jaxflash.append_kv` + `jaxflash.paged_attention`, pages handed out in shuffled order) and with a
contiguous cache read by `jax.nn.dot_product_attention`. Prompts are prefilled in one call, then one token per
call. Prints the continuations and tokens/s of both, checks the paged cache's tokens against the contiguous
cache's and against the model run without a cache on the whole text, and exits 1 if they differ (unless at a near
tie of the two best logits, which bf16 rounding may break either way).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
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
    from flax import struct
    import optax
except ImportError as e:  # pragma: no cover
    raise SystemExit(f"jaxflash.demo needs flax (pip install flax): {e}") from e


# --- the model --------------------------------------------------------------------------------------------

def flash(q, k, v):
    return jaxflash.attention(q, k, v, causal=True)


def standard(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


class Block(nn.Module):
    heads: int
    attention: Callable
    dtype: Any

    @nn.compact
    def __call__(self, x, cache=None):
        """x [B, S, W] -> (x, cache). With a KV cache, x is the tokens after the cached ones, and the cache's
        `attend` stores their keys and values and attends to everything cached so far."""
        b, s, w = x.shape
        qkv = nn.Dense(3 * w, use_bias=False)(nn.LayerNorm()(x)).reshape(b, s, 3, self.heads, w // self.heads)
        q, k, v = (qkv[:, :, i].astype(self.dtype) for i in range(3))  # [B, S, H, D], as jaxflash takes them
        if cache is None:
            o = self.attention(q, k, v)
        else:
            o, cache = cache.attend(q, k, v)
        x = x + nn.Dense(w)(o.astype(x.dtype).reshape(b, s, w))
        return x + nn.Dense(w)(nn.gelu(nn.Dense(4 * w)(nn.LayerNorm()(x)))), cache


class GPT(nn.Module):
    vocab: int
    width: int
    heads: int
    layers: int
    seq: int
    attention: Callable
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens, caches=None, start=0):
        """Logits of `tokens` [B, S]; with `caches` (one per layer), the tokens sit at positions start ..
        start + S - 1 after the cached ones, and the result is (logits, updated caches)."""
        pos = self.param("pos", nn.initializers.normal(0.02), (self.seq, self.width))
        x = nn.Embed(self.vocab, self.width)(tokens) + jax.lax.dynamic_slice_in_dim(pos, start, tokens.shape[1])
        updated = []
        for i in range(self.layers):
            x, cache = Block(self.heads, self.attention, self.dtype)(x, None if caches is None else caches[i])
            updated.append(cache)
        logits = nn.Dense(self.vocab)(nn.LayerNorm()(x))
        return logits if caches is None else (logits, updated)


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
    """Losses per step, tokens/s (after the compiling first step), the train step's peak MB, trained params."""
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
    return np.asarray(jax.device_get(losses), np.float64), tokens_per_s, mem, params


def setup(cfg, out):
    """The text, its symbols, the text as symbol ids, and the model's initial weights (printed)."""
    text = load_text()
    chars = sorted(set(text))
    data = np.array([chars.index(c) for c in text], np.int32)
    init_model = GPT(len(chars), cfg.width, cfg.heads, cfg.layers, cfg.seq, standard, jnp.dtype(cfg.dtype))
    params = init_model.init(jax.random.key(cfg.seed), np.zeros((1, cfg.seq), np.int32))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    out(f"jaxflash.demo: char-level GPT on Coriolanus ({len(text):,} chars, {len(chars)} symbols), {n_params:,} "
        f"parameters: {cfg.layers} layers, width {cfg.width}, {cfg.heads} heads (D={cfg.width // cfg.heads}), seq "
        f"{cfg.seq}, batch {cfg.batch}, {cfg.steps} steps, attention in {cfg.dtype}, on {jax.devices()[0].device_kind}")
    return text, chars, data, params


def run(cfg, every=25, out=print):
    """Both trainings; returns (flash losses, standard losses, max relative difference of the means over
    windows of `every` steps, tolerance)."""
    text, chars, data, params = setup(cfg, out)
    runs = {name: train(cfg, fn, params, data, len(chars)) for name, fn in (("jaxflash", flash),
                                                                           ("standard", standard))}
    (lf, tf, mf, _), (ls, ts, ms, _) = runs["jaxflash"], runs["standard"]
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


# --- generation with a KV cache ---------------------------------------------------------------------------

@struct.dataclass
class PagedCache:
    """One layer's keys and values in pages [num_pages, page_size, H, D], found through the block table."""
    key: jax.Array
    value: jax.Array
    tables: jax.Array  # int32 [B, pages per sequence]
    lengths: jax.Array  # int32 [B]: tokens cached per sequence

    def attend(self, q, k, v):
        key, value, lengths = jaxflash.append_kv(self.key, self.value, self.tables, self.lengths, k, v)
        o = jaxflash.paged_attention(q, key, value, self.tables, lengths, causal=True)
        return o, PagedCache(key, value, self.tables, lengths)


@struct.dataclass
class ContiguousCache:
    """One layer's keys and values in [B, seq, H, D]; every sequence holds `length` tokens."""
    key: jax.Array
    value: jax.Array
    length: jax.Array  # int32 scalar

    def attend(self, q, k, v):
        key = jax.lax.dynamic_update_slice_in_dim(self.key, k, self.length, axis=1)
        value = jax.lax.dynamic_update_slice_in_dim(self.value, v, self.length, axis=1)
        rows = self.length + jnp.arange(q.shape[1])  # the new tokens' positions; each sees itself and before
        mask = jnp.arange(key.shape[1])[None, :] <= rows[:, None]
        o = jax.nn.dot_product_attention(q, key, value, mask=mask[None, None], implementation="xla")
        return o, ContiguousCache(key, value, self.length + q.shape[1])


def paged_caches(cfg, batch, page_size, rng):
    """Empty paged caches for every layer, sharing one block table whose pages come in shuffled order."""
    tables, num_pages = jaxflash.paged.simple_block_tables(batch, cfg.seq, page_size)
    tables = jnp.asarray(rng.permutation(num_pages), jnp.int32)[tables]
    shape = (num_pages, page_size, cfg.heads, cfg.width // cfg.heads)
    # Separate arrays everywhere: the decoding step donates the caches, and a buffer can be donated only once.
    return [PagedCache(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype), jnp.array(tables),
                       jnp.zeros(batch, jnp.int32)) for _ in range(cfg.layers)]


def contiguous_caches(cfg, batch):
    shape = (batch, cfg.seq, cfg.heads, cfg.width // cfg.heads)
    return [ContiguousCache(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype), jnp.zeros((), jnp.int32))
            for _ in range(cfg.layers)]


def greedy(logits):
    """The greedy choice over the last axis and its lead over the runner-up (how near a tie it was)."""
    top2 = jax.lax.top_k(logits.astype(jnp.float32), 2)[0]
    return jnp.argmax(logits, -1).astype(jnp.int32), top2[..., 0] - top2[..., 1]


def generate(model, params, caches, prompts, new_tokens):
    """Greedy continuation of `prompts` [B, P]: the prompt in one call, then one token per call (the choice made
    inside the call). Returns the new tokens [B, new_tokens], the top-two logit margin at each step, and
    tokens/s of the one-token calls after the first (which compiles)."""
    @jax.jit
    def prefill(params, caches, prompt):
        logits, caches = model.apply(params, prompt, caches, 0)
        return *greedy(logits[:, -1]), caches

    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, caches, token, start):
        logits, caches = model.apply(params, token[:, None], caches, start)
        return *greedy(logits[:, -1]), caches

    token, margin, caches = prefill(params, caches, prompts)
    tokens, margins, t0 = [token], [margin], None
    for i in range(1, new_tokens):
        token, margin, caches = step(params, caches, token, jnp.int32(prompts.shape[1] + i - 1))
        tokens.append(token)
        margins.append(margin)
        if i == 1:
            jax.block_until_ready(token)
            t0 = time.perf_counter()
    jax.block_until_ready(tokens[-1])
    timed = new_tokens - 2  # the one-token calls after the compiling one
    tokens_per_s = timed * prompts.shape[0] / (time.perf_counter() - t0) if timed > 0 else float("nan")
    return np.stack(jax.device_get(tokens), 1), np.stack(jax.device_get(margins), 1), tokens_per_s


def run_generate(cfg, prompt_len=32, new_tokens=96, page_size=16, num_prompts=4, out=print):
    """Train with jaxflash, then generate through both caches, and check the paged one's tokens against the
    contiguous one's and against the model without a cache. Returns (paged tokens, contiguous tokens, whether all
    agree: equal, or first differing at a near tie)."""
    text, chars, data, params = setup(cfg, out)
    _, _, _, params = train(cfg, flash, params, data, len(chars))
    rng = np.random.default_rng(cfg.seed)
    starts = rng.integers(0, len(data) - prompt_len, num_prompts)
    prompts = jnp.asarray(np.stack([data[s:s + prompt_len] for s in starts]))
    model = GPT(len(chars), cfg.width, cfg.heads, cfg.layers, cfg.seq, flash, jnp.dtype(cfg.dtype))
    out(f"\ntrained {cfg.steps} steps with jaxflash; {num_prompts} prompts of {prompt_len} characters from the text, "
        f"{new_tokens} new characters each, greedy")
    paged, _, paged_tps = generate(model, params, paged_caches(cfg, num_prompts, page_size, rng), prompts,
                                   new_tokens)
    contiguous, margins, contiguous_tps = generate(model, params, contiguous_caches(cfg, num_prompts), prompts,
                                                   new_tokens)
    for b in range(num_prompts):
        prompt = "".join(chars[c] for c in np.asarray(prompts[b]))
        out(f"\n[{b}] {prompt!r}\n -> {''.join(chars[c] for c in paged[b])!r}")
    out(f"\n{'':44}{'tokens/s':>10}")
    out(f"{f'paged cache ({page_size}-token pages), jaxflash':44}{paged_tps:10,.0f}")
    out(f"{'contiguous cache, jax.nn (xla)':44}{contiguous_tps:10,.0f}\n")
    # Without a cache: the whole text so far through the model in one call must predict the same characters.
    logits = model.apply(params, jnp.concatenate([prompts, jnp.asarray(paged)], 1)[:, :-1])[:, prompt_len - 1:]
    uncached, uncached_margins = (np.asarray(x) for x in greedy(logits))
    tie = 1e-3 if cfg.dtype == "float32" else 0.1
    agree = True
    for name, other, m in (("contiguous cache", contiguous, margins), ("no cache", uncached, uncached_margins)):
        differ = np.argwhere(paged != other)
        if not len(differ):
            out(f"tokens, paged vs {name}: identical ({paged.size} of {paged.size})")
            continue
        b, i = differ[np.argmin(differ[:, 1])]  # the earliest step where a sequence differs
        near = m[b, i] <= tie
        agree &= bool(near)
        out(f"tokens, paged vs {name}: {int((paged == other).sum())} of {paged.size} equal; first difference at "
            f"step {i} of prompt {b}, where the two best logits were {m[b, i]:.2e} apart: "
            f"{f'a near tie (<= {tie:g})' if near else 'DIFFERENT'}")
    return paged, contiguous, agree


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m jaxflash.demo", description=__doc__.splitlines()[0])
    p.add_argument("--large", action="store_true", help=f"a GPU-sized run: {LARGE}")
    for f in dataclasses.fields(Config):
        p.add_argument(f"--{f.name}", type=type(f.default) if f.name != "dtype" else str, default=None)
    p.add_argument("--every", type=int, default=25, help="steps per printed (and compared) window")
    p.add_argument("--generate", action="store_true",
                   help="train with jaxflash, then generate through a paged and a contiguous KV cache")
    p.add_argument("--prompt-len", type=int, default=32, help="--generate: characters per prompt")
    p.add_argument("--new-tokens", type=int, default=96, help="--generate: characters to generate per prompt")
    p.add_argument("--page-size", type=int, default=16, help="--generate: tokens per page")
    args = p.parse_args(argv)
    if args.every < 1:
        p.error(f"--every must be >= 1; got {args.every}")
    cfg = Config(**(LARGE if args.large else {}))
    for f in dataclasses.fields(Config):
        if getattr(args, f.name) is not None:
            setattr(cfg, f.name, getattr(args, f.name))
    if args.generate:
        if args.prompt_len < 1 or args.new_tokens < 1 or args.prompt_len + args.new_tokens > cfg.seq:
            p.error(f"--prompt-len and --new-tokens must be >= 1 and together at most --seq ({cfg.seq}); got "
                    f"{args.prompt_len} and {args.new_tokens}")
        if args.page_size % 8 or not 8 <= args.page_size <= 256:
            p.error(f"--page-size must be a multiple of 8 in [8, 256]; got {args.page_size}")
        try:
            _, _, agree = run_generate(cfg, args.prompt_len, args.new_tokens, args.page_size)
        except NotImplementedError as e:  # the paged kernel of this platform is missing
            print(f"jaxflash.demo --generate: {e}", file=sys.stderr)
            return 2
        return 0 if agree else 1
    _, _, diff, tol = run(cfg, args.every)
    return 0 if diff <= tol else 1


if __name__ == "__main__":
    sys.exit(main())
