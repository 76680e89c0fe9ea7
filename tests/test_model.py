"""Pieces of the model with a hand-written gradient, against autodiff of their plain formula."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from jax3d.model import layers


def _plain_swiglu(gu_r2f):
  return nn.silu(gu_r2f[:, 0].astype(jnp.float32)) * gu_r2f[:, 1].astype(jnp.float32)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_swiglu_value_and_gradient_equal_autodiff(dtype):
  gu_r2f = (3 * jax.random.normal(jax.random.key(0), (64, 2, 48))).astype(dtype)
  w_rf = jax.random.normal(jax.random.key(1), (64, 48))
  loss = lambda fn: jax.value_and_grad(lambda gu: jnp.sum(fn(gu) * w_rf))(gu_r2f)
  (value, grad), (want_value, want_grad) = loss(layers.swiglu), loss(_plain_swiglu)
  assert grad.dtype == dtype and grad.shape == gu_r2f.shape
  chex.assert_trees_all_close(value, want_value, rtol=0)
  # float32: the same derivative summed in another order; bf16: both round the fp32 result once.
  chex.assert_trees_all_close(grad.astype(jnp.float32), want_grad.astype(jnp.float32), atol=1e-5, rtol=1e-6)
  assert float(jnp.max(jnp.abs(grad.astype(jnp.float32)))) > 1  # a gradient, not zeros
