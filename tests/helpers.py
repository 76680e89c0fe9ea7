"""Small shared pieces of the tests: a small model config and a one-layout runner."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax3d import assemble, config as config_lib, step as step_lib
from jax3d.data import packing
from jax3d.model import llama
from jax3d.parallel import placement

SMALL = {
  'model.n_layers': 8,
  'model.d_model': 64,
  'model.n_heads': 8,
  'model.n_kv_heads': 8,
  'model.d_ff': 128,
  'model.vocab_size': 256,
  'train.seq_len': 16,
  'train.global_batch_size': 32,
  'train.warmup_steps': 1,
  'train.lr': 1e-2,
  'mesh.dp': 1,
  'mesh.pp': 1,
  'mesh.tp': 1,
  'pipeline.microbatches': 1,
  'train.grad_clip': 0.0,
}


def small_cfg(**over):
  ov = dict(SMALL)
  ov.update({k.replace('__', '.'): v for k, v in over.items()})
  return config_lib.load_config('tiny', ov)


def setup_for(cfg):
  n = cfg.mesh.dp * cfg.mesh.cp * cfg.mesh.ep * cfg.mesh.pp * cfg.mesh.tp
  return assemble.build(cfg, jax.devices()[:n])


def fixed_batches(cfg, n, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    t = rng.integers(0, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.train.seq_len + 1))
    out.append(packing.one_document_rows(t))
  return out


def canonical(s, params):
  """Parameters with the layer axis in canonical order (layout-independent), on the host."""
  params = dict(params)
  params['layers'] = placement.to_canonical(params['layers'], s.dims.n_layers, s.plan.pp, s.plan.repeats)
  return jax.device_get(params)


def run_steps(cfg, n_steps=3, batches=None):
  """Losses of the first n steps, the step-1 gradients (canonical order) and the initial params;
  on `batches` (host dicts of the five batch arrays) or `fixed_batches`.

  The gradients are read from Adam's first moment after step 1, mu = (1 - b1) * g (clipping is
  off in these configs), so one compiled train step gives both losses and gradients.
  """
  s = setup_for(cfg)
  assert cfg.train.grad_clip == 0, 'gradients are read from Adam mu: clipping must be off'
  state = step_lib.make_init(s)(cfg.train.seed)
  sh = s.batch_sharding
  batches = batches or fixed_batches(cfg, n_steps)
  batches = [{k: jax.device_put(v, sh) for k, v in b.items()} for b in batches]
  init_params = canonical(s, state['params'])
  train = assemble.compile_train_step(s)  # the trainer's own compile path
  losses, grads = [], None
  for b in batches:
    state, m = train(state, b)
    losses.append(float(m['loss']))
    if grads is None:
      mu = optax.tree.get(state['opt_state'], 'mu')
      grads = jax.tree.map(lambda x: x / (1 - cfg.train.b1), canonical(s, mu))
  return np.array(losses), grads, init_params


@functools.partial(jax.jit, static_argnums=(0,))
def cached_logits(dims, params, layers, tokens_bt, cache, pos0):
  """Logits of the last position and the updated KV cache, for tokens at positions pos0.. (layers
  in canonical order): one decoding step built from the model's public pieces (embed, the layer's
  KV-cache path, head)."""
  positions_t = pos0 + jnp.arange(tokens_bt.shape[1])

  def body(x_btd, layer):
    p, k_bskh, v_bskh = layer
    return llama.block_apply(dims, p, x_btd, positions_t, (k_bskh, v_bskh))

  x_btd, cache = jax.lax.scan(body, llama.embed_apply(dims, params, tokens_bt), (layers, *cache))
  return llama.head_apply(dims, params, x_btd[:, -1:])[:, 0], cache
