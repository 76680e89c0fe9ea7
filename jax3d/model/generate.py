"""Text generation from a model's parameters: greedy, or temperature with top-k.

Generation runs the layers in their canonical order (no pipeline schedule) with a KV cache:
one forward over the prompt fills the cache, then one token per step. It works on any layout:
the parameters keep their training shardings and the compiler gathers what each step needs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax3d.model import llama as model_lib
from jax3d.parallel import pipeline


def _attend(q_bqnh, k_bskh, v_bskh, pos_q, length):
  """Causal attention of queries at positions pos_q over cache entries [0, length)."""
  b, qn, n, h = q_bqnh.shape
  kvh = k_bskh.shape[2]
  q = q_bqnh.reshape(b, qn, kvh, n // kvh, h)
  s = jnp.einsum('bqkgh,bskh->bkgqs', q.astype(jnp.float32), k_bskh.astype(jnp.float32)) / np.sqrt(h)
  key_pos = jnp.arange(k_bskh.shape[1])
  mask = (key_pos[None, :] <= pos_q[:, None]) & (key_pos[None, :] < length)
  s = jnp.where(mask[None, None, None], s, -1e30)
  o = jnp.einsum('bkgqs,bskh->bqkgh', jax.nn.softmax(s, axis=-1), v_bskh.astype(jnp.float32))
  return o.reshape(b, qn, n, h).astype(q_bqnh.dtype)


def _rope_at(x_btnh, pos_t, theta):
  h = x_btnh.shape[-1]
  inv = 1.0 / (theta ** (np.arange(0, h, 2, dtype=np.float32) / h))
  ang = pos_t.astype(jnp.float32)[:, None] * inv[None, :]
  cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
  x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_btnh.dtype)


def _layer_cached(dims, p, x_btd, cache, pos_t, length):
  """One decoder layer with a KV cache; the same maths as model.Block."""
  norm = lambda scale, x: (x.astype(jnp.float32) * jax.lax.rsqrt(
      jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + dims.norm_eps) * scale).astype(dims.dtype)
  a = norm(p['attn_norm']['scale'], x_btd)
  b, t, _ = x_btd.shape
  kv, gq = dims.n_kv_heads, dims.n_heads // dims.n_kv_heads
  qkv = jnp.einsum('btd,dkch->btkch', a, p['qkv']['kernel'].astype(dims.dtype))
  q = _rope_at(qkv[:, :, :, :gq].reshape(b, t, dims.n_heads, dims.head_dim), pos_t, dims.rope_theta)
  k = _rope_at(qkv[:, :, :, gq], pos_t, dims.rope_theta)
  v = qkv[:, :, :, gq + 1]
  k_cache = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache.dtype), pos_t[0], axis=1)
  v_cache = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache.dtype), pos_t[0], axis=1)
  o = _attend(q, k_cache, v_cache, pos_t, length)
  x_btd = x_btd + jnp.einsum('btnh,nhd->btd', o, p['o']['kernel'].astype(dims.dtype))
  m = norm(p['mlp_norm']['scale'], x_btd)
  gu = jnp.einsum('btd,dsf->btsf', m, p['gate_up']['kernel'].astype(dims.dtype))
  y = jnp.einsum('btf,fd->btd', jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1], p['down']['kernel'].astype(dims.dtype))
  return x_btd + y, jnp.stack([k_cache, v_cache])


@functools.partial(jax.jit, static_argnums=(0,))
def _forward(dims, params, layers, tokens_bt, cache_lkbskh, pos0):
  """Logits of the last position and the updated cache, for tokens at positions pos0.. ."""
  t = tokens_bt.shape[1]
  pos_t = pos0 + jnp.arange(t)
  x = jnp.take(params['embed']['embedding'], tokens_bt, axis=0).astype(dims.dtype)

  def body(x, pc):
    p, c = pc
    x, c = _layer_cached(dims, p, x, c, pos_t, pos0 + t)
    return x, c

  x, cache = jax.lax.scan(body, x, (layers, cache_lkbskh))
  logits = model_lib.head_apply(dims, params, x[:, -1:])[:, 0]
  return logits, cache


def generate(dims, params, layout, prompt: bytes | list[int], n_tokens: int, max_len: int,
             temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> list[int]:
  """Tokens following `prompt` (greedy when temperature == 0). `layout` = (n_layers, pp, repeats)
  tells the stored layer order."""
  tokens = list(prompt) or [10]
  tokens = tokens[-max_len:]
  n_tokens = min(n_tokens, max_len - len(tokens))
  layers = pipeline.to_canonical(params['layers'], *layout)
  cache = jnp.zeros((dims.n_layers, 2, 1, max_len, dims.n_kv_heads, dims.head_dim), dims.dtype)
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
