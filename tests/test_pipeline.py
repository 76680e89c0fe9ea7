"""The pipeline function equals a plain sequential loop over the same layers, value and gradient,
for p in {2, 4, 8}, m in {1, p, 2p}, v in {1, 2} (the circular schedule needs m >= p)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jax3d.parallel import pipeline, placement
from jax3d.parallel.pipeline import chunk

D, B, T = 8, 4, 4  # model width, micro-batch rows, sequence


def layer_fn(p, x_btd, side=None):
  """A small nonlinear layer with two weights (residual MLP); no per-row side inputs."""
  return x_btd + jnp.tanh(x_btd @ p['w1']) @ p['w2'] * p['s']


def make(p, m, v, seed=0):
  L = p * v * 2
  k = jax.random.split(jax.random.key(seed), 4)
  layers = {
    'w1': jax.random.normal(k[0], (L, D, D)) / D**0.5,
    'w2': jax.random.normal(k[1], (L, D, D)) / D**0.5,
    's': jax.random.uniform(k[2], (L, 1)),
  }
  x = jax.random.normal(k[3], (m, B, T, D))
  return layers, x


def sequential(layers, x_mbtd):
  return jax.vmap(lambda x: chunk.run_layers(layer_fn, layers, x, 'none'))(x_mbtd)


def loss(y):
  return jnp.sum(jnp.sin(y) * jnp.arange(y.size).reshape(y.shape) / y.size)


CASES = [(p, m, v) for p in (2, 4, 8) for v in (1, 2) for m in (1, p, 2 * p) if not (v > 1 and m < p)]


@pytest.mark.parametrize('policy', ['none', 'full', pytest.param('stage', marks=pytest.mark.slow)])
@pytest.mark.parametrize('skip', [True, False], ids=['skip_bubbles', 'compute_bubbles'])
@pytest.mark.parametrize('p,m,v', CASES)
def test_pipeline_equals_sequential(p, m, v, skip, policy):
  """Under 'none' JAX differentiates the loop; under 'full' and 'stage' its backward pass is
  written out (gpipe.GPipe.backward)."""
  devices = np.array(jax.devices()[: p * (8 // p)]).reshape(8 // p, p, 1)
  mesh = Mesh(devices, ('dp', 'pp', 'tp'), axis_types=(AxisType.Auto,) * 3)
  layers, x = make(p, m, v)
  L = layers['w1'].shape[0]
  stored = placement.from_canonical(layers, L, p, v)  # the stage-major storage order
  stored = jax.device_put(stored, NamedSharding(mesh, P('pp')))

  def piped(stored, x):
    return pipeline.run(layer_fn, stored, x, mesh=mesh, repeats=v, policy=policy, skip_bubbles=skip)

  with jax.set_mesh(mesh):
    y, (g_layers, g_x) = jax.jit(
      lambda s, x: (piped(s, x), jax.grad(lambda s, x: loss(piped(s, x)), argnums=(0, 1))(s, x))
    )(stored, x)
  y_ref, (g_ref, gx_ref) = jax.jit(
    lambda l, x: (sequential(l, x), jax.grad(lambda l, x: loss(sequential(l, x)), argnums=(0, 1))(l, x))
  )(layers, x)
  close(y, y_ref)
  jax.tree.map(close, placement.to_canonical(g_layers, L, p, v), g_ref)
  close(g_x, gx_ref)


def close(a, b):
  """rtol 1e-5, with an absolute floor of 1e-5 of the array's scale: fp32 sums in another order
  (deep, summed over micro-batches) cancel differently in elements much smaller than the rest."""
  b = np.asarray(b)
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


def test_layer_order_round_trip_and_stage_chunks():
  order = placement.layer_order(8, 2, 2)  # chunks of 2 layers; chunk c runs on stage c mod 2
  assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
  x = {'a': np.arange(8)}
  assert placement.to_canonical(placement.from_canonical(x, 8, 2, 2), 8, 2, 2)['a'].tolist() == list(range(8))
  assert placement.layer_order(8, 4, 1).tolist() == list(range(8))
