"""The optimizer's own parts against optax's."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax3d import config as config_lib, optim


def _grads(norm: float) -> dict:
  rng = np.random.default_rng(0)
  tree = {
    'a': rng.normal(size=(64, 32)),
    'b': {'kernel': rng.normal(size=(3, 16, 8)), 'scale': rng.normal(size=(8,))},
  }
  tree = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)
  return jax.tree.map(lambda x: x * (norm / optax.tree.norm(tree)), tree)


@pytest.mark.parametrize('norm', [0.25, 1.0, 7.5])
def test_clip_by_global_norm_equals_optax(norm):
  grads = _grads(norm)
  ours = optim.clip_by_global_norm(1.0)
  theirs = optax.clip_by_global_norm(1.0)
  got, _ = ours.update(grads, ours.init(grads))
  want, _ = theirs.update(grads, theirs.init(grads))
  if norm < 1.0:  # unclipped: the very same numbers
    chex.assert_trees_all_equal(got, want)
  else:
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=0)
    np.testing.assert_allclose(float(optax.tree.norm(got)), 1.0, rtol=1e-6)


def test_optimizer_step_equals_optax_chain(monkeypatch):
  """make_optimizer's AdamW with clipping, three steps, against the same chain built with optax's
  own clip: the parameters agree to float32 rounding."""
  cfg = config_lib.load_config('tiny', {'train.grad_clip': 1.0, 'train.steps': 10, 'train.warmup_steps': 2})
  ours = optim.make_optimizer(cfg)
  monkeypatch.setattr(optim, 'clip_by_global_norm', optax.clip_by_global_norm)
  reference = optim.make_optimizer(cfg)
  params = _grads(3.0)
  runs = []
  for tx in (ours, reference):
    p, state = params, tx.init(params)
    for k in range(3):
      updates, state = tx.update(_grads(0.5 + 2.0 * k), state, p)
      p = optax.apply_updates(p, updates)
    runs.append(p)
  chex.assert_trees_all_close(runs[0], runs[1], rtol=1e-6, atol=1e-7)
  assert not np.allclose(np.asarray(runs[0]['a']), np.asarray(params['a']))  # the steps did move them
