"""Text generation from a model's parameters: greedy, or temperature with top-k.

Generation runs the training model's own layer (jax3d.model.llama.Block, with its KV-cache path)
in the canonical layer order (no pipeline schedule): one forward over the prompt fills the cache,
then one token per step. It works on any layout: the parameters keep their training shardings and the
compiler gathers what each step needs.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jax3d.model import llama as model_lib
from jax3d.parallel import pipeline

if TYPE_CHECKING:
  from jax3d.run import Setup


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
  layers = pipeline.to_canonical(params['layers'], *layout)
  cache = empty_cache(dims, 1, max_len)
  logits, cache = _forward(dims, params, layers, jnp.asarray([tokens], jnp.int32), cache, 0)
  key = jax.random.key(seed)
  out = []
  for i in range(n_tokens):
    logits = logits[:, : dims.vocab_size]
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
    if tok == stop:
      break
    if i + 1 < n_tokens:
      logits, cache = _forward(dims, params, layers, jnp.asarray([[tok]], jnp.int32), cache, len(tokens) + i)
  return out


def generate_text(
  setup: Setup, params: Any, prompt: str, n_tokens: int, temperature: float, top_k: int, seed: int
) -> str:
  """prompt + up to n_tokens generated tokens from `params` (stored in the pipeline layer order of
  the jax3d.run.Setup `setup`), encoded and decoded with the run's tokenizer (data.tokenizer): the
  prompt after BOS where the tokenizer has one, generation stopping at EOS."""
  from jax3d.training import tokenizer

  cfg, plan = setup.cfg, setup.plan
  tok = tokenizer.load(cfg.data.tokenizer)
  ids = tok.encode(prompt)
  toks = generate(
    setup.dims,
    params,
    (cfg.model.n_layers, plan.pp, plan.repeats),
    ([tok.bos_id] if tok.bos_id is not None else []) + ids,
    n_tokens,
    cfg.model.max_seq_len,
    temperature,
    top_k,
    seed,
    stop=tok.eos_id,
  )
  return tok.decode(ids + toks)
