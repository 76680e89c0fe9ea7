"""Text generation from a model's parameters: greedy, or temperature with top-k.

Generation runs the training model's own layer (model.Block, with its KV-cache path) in the
canonical layer order (no pipeline schedule): one forward over the prompt fills the cache, then
one token per step. It works on any layout: the parameters keep their training shardings and the
compiler gathers what each step needs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax3d.model import llama as model_lib
from jax3d.parallel import pipeline


def empty_cache(dims: model_lib.Dims, batch: int, max_len: int) -> tuple:
  """The KV cache of every layer, zero: (keys, values), each [layers, b, max_len, k, h]."""
  shape = (dims.n_layers, batch, max_len, dims.n_kv_heads, dims.head_dim)
  return jnp.zeros(shape, dims.dtype), jnp.zeros(shape, dims.dtype)


@functools.partial(jax.jit, static_argnums=(0,))
def _forward(dims, params, layers, tokens_bt, cache, pos0):
  """Logits of the last position and the updated cache, for tokens at positions pos0.. ."""
  positions_t = pos0 + jnp.arange(tokens_bt.shape[1])
  x_btd = model_lib.embed_apply(dims, params, tokens_bt)

  def body(x_btd, layer):
    p, k_bskh, v_bskh = layer
    return model_lib.block_apply(dims, p, x_btd, positions_t, (k_bskh, v_bskh))

  x_btd, cache = jax.lax.scan(body, x_btd, (layers, *cache))
  logits = model_lib.head_apply(dims, params, x_btd[:, -1:])[:, 0]
  return logits, cache


def generate(dims, params, layout, prompt: bytes | list[int], n_tokens: int, max_len: int,
             temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> list[int]:
  """Tokens following `prompt` (greedy when temperature == 0). `layout` = (n_layers, pp, repeats)
  tells the stored layer order."""
  tokens = list(prompt) or [10]
  tokens = tokens[-max_len:]
  n_tokens = min(n_tokens, max_len - len(tokens))
  layers = pipeline.to_canonical(params['layers'], *layout)
  cache = empty_cache(dims, 1, max_len)
  logits, cache = _forward(dims, params, layers, jnp.asarray([tokens], jnp.int32), cache, 0)
  key = jax.random.key(seed)
  out = []
  for i in range(n_tokens):
    logits = logits[:, :dims.vocab_size]
    if temperature <= 0:
      nxt = jnp.argmax(logits, -1)
    else:
      key, sub = jax.random.split(key)
      scaled = logits / temperature
      if top_k and top_k < scaled.shape[-1]:
        kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
        scaled = jnp.where(scaled < kth, -1e30, scaled)
      nxt = jax.random.categorical(sub, scaled, -1)
    tok = int(nxt[0])
    out.append(tok)
    if i + 1 < n_tokens:
      logits, cache = _forward(dims, params, layers, jnp.asarray([[tok]], jnp.int32), cache,
                               len(tokens) + i)
  return out


def decode_bytes(tokens: list[int]) -> str:
  return bytes(t for t in tokens if t < 256).decode('utf-8', errors='replace')
