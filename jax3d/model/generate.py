"""Text generation from a model's parameters: greedy, or temperature with top-k.

Generation runs the training model's own layer (jax3d.model.layers.Block, with its KV-cache path)
in the canonical layer order (no pipeline schedule): one forward over the prompt (padded to a
power-of-two bucket) fills the cache, then one token per step, all in one compiled program (a
`fori_loop`, sampling on the device). It works on any layout: small models are decoded on one
device; larger ones keep their training shardings and the compiler gathers what each step needs.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax3d.model import llama as model_lib
from jax3d.parallel import placement


def empty_cache(dims: model_lib.Dims, batch: int, max_len: int) -> tuple:
  """The KV cache of every layer, zero: (keys, values), each [layers, b, max_len, k, h]."""
  shape = (dims.n_layers, batch, max_len, dims.n_kv_heads, dims.head_dim)
  return jnp.zeros(shape, dims.dtype), jnp.zeros(shape, dims.dtype)


def _run(dims, params, layers, tokens_bt, cache, pos0):
  """Hidden states [b, t, d] for tokens at positions pos0.. and the updated cache."""
  positions_t = pos0 + jnp.arange(tokens_bt.shape[1])
  x_btd = model_lib.embed_apply(dims, params, tokens_bt)

  def body(x_btd, layer):
    p, k_bskh, v_bskh = layer
    return model_lib.block_apply(dims, p, x_btd, positions_t, (k_bskh, v_bskh))

  return jax.lax.scan(body, x_btd, (layers, *cache))


def _pick(logits_bv, temperature, top_k, key):
  """The next token: the argmax when temperature <= 0, else a draw from softmax(logits / T)
  among the top_k largest (top_k 0: all)."""
  scaled = logits_bv / jnp.maximum(temperature, 1e-6)
  if top_k and top_k < scaled.shape[-1]:
    kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
    scaled = jnp.where(scaled < kth, -1e30, scaled)
  drawn = jax.random.categorical(key, scaled, -1)
  return jnp.where(temperature <= 0, jnp.argmax(logits_bv, -1), drawn).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=('dims', 'layout', 'n_tokens', 'top_k', 'cache_len'))
def _generate(dims, layout, params, prompt_bt, n_prompt, n_tokens, top_k, temperature, seed, cache_len, stop):
  """Up to n_tokens after the first n_prompt tokens of prompt_bt (padded to a bucket length), in
  one program: the prefill, then a loop of one-token steps through a KV cache of cache_len
  positions (at least the bucket and n_prompt + n_tokens), sampling on the device (no host round
  trip per token), ending after the token `stop` (-1: never). Compiled once per bucket, n_tokens
  and cache_len; the layer reorder, the cache and the key are made inside (no eager op to compile
  first). Returns the tokens (-1 past the end) and how many."""
  layers = placement.to_canonical(params['layers'], *layout)
  cache = empty_cache(dims, 1, cache_len)
  key = jax.random.key(seed)
  # The padding past n_prompt writes cache entries that each decode step overwrites before any
  # query can see them (a query at position p attends to entries 0..p).
  x_btd, cache = _run(dims, params, layers, prompt_bt, cache, 0)
  last = jax.lax.dynamic_slice_in_dim(x_btd, n_prompt - 1, 1, axis=1)
  logits = model_lib.head_apply(dims, params, last)[:, 0]

  def go_on(carry):
    i, done = carry[0], carry[1]
    return (i < n_tokens) & ~done

  def step(carry):
    i, _, logits, cache, key, out = carry
    key, sub = jax.random.split(key)
    tok_b = _pick(logits[:, : dims.vocab_size], temperature, top_k, sub)
    x_btd, cache = _run(dims, params, layers, tok_b[:, None], cache, n_prompt + i)
    logits = model_lib.head_apply(dims, params, x_btd)[:, 0]
    return i + 1, tok_b[0] == stop, logits, cache, key, out.at[i].set(tok_b[0])

  init = (jnp.int32(0), jnp.bool_(False), logits, cache, key, jnp.full(n_tokens, -1, jnp.int32))
  i, _, _, _, _, out = jax.lax.while_loop(go_on, step, init)
  return out, i


# Parameters up to this size are decoded on one device: a decode step is tiny, and on the training
# layout each one would wait on tp/pp collectives.
ONE_DEVICE_BYTES = 1 << 30


def _for_decoding(params: Any) -> Any:
  """`params` on one local device when they are small and this is a single-process run, else as
  they are (their training shardings; the compiler gathers what each step needs)."""
  size = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
  if jax.process_count() == 1 and size <= ONE_DEVICE_BYTES:
    return jax.device_put(params, jax.local_devices()[0])
  return params


def _pow2_at_most(n: int, cap: int) -> int:
  """The power of two >= n, but at most cap."""
  return min(cap, 1 << (n - 1).bit_length())


def generate(
  dims: model_lib.Dims,
  params: Any,
  layout: tuple[int, int, int],
  prompt: bytes | list[int],
  n_tokens: int,
  max_len: int,
  temperature: float = 0.8,
  top_k: int = 40,
  seed: int = 0,
  stop: int | None = None,
) -> list[int]:
  """Tokens following `prompt` (greedy when temperature == 0), ending early after the token `stop`
  (EOS). `layout` = (n_layers, pp, repeats) tells the stored layer order."""
  tokens = list(prompt) or [10]
  tokens = tokens[-max_len:]
  n_tokens = min(n_tokens, max_len - len(tokens))
  if n_tokens <= 0:
    return []
  bucket = _pow2_at_most(max(16, len(tokens)), max_len)  # few prompt shapes to compile
  # The cache holds what this request needs, not max_len: each token attends over all of it.
  cache_len = _pow2_at_most(max(bucket, len(tokens) + n_tokens), max_len)
  out = _generate(
    dims,
    tuple(layout),
    _for_decoding(params),
    np.asarray([tokens + [0] * (bucket - len(tokens))], np.int32),
    len(tokens),
    n_tokens,
    top_k,
    float(temperature),
    seed,
    cache_len,
    -1 if stop is None else stop,
  )
  return [int(t) for t in jax.device_get(out[0])[: int(out[1])]]
