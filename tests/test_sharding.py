"""Sharding is data: the PartitionSpec of every parameter of the tiny model, and the Megatron
collectives of one layer's compiled forward pass."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax3d import assemble, config as config_lib
from jax3d.analysis import hlo as hlo_lib
from jax3d.model import llama as model_lib
from jax3d.parallel import sharding

EXPECTED = {  # tiny model under (dp, pp, tp) = (2, 2, 2)
  'embed/embedding': P('tp', None),  # vocabulary-parallel
  'head/norm/scale': P(None),
  'head/out/kernel': P(None, 'tp'),  # vocabulary-parallel head
  'layers/attn_norm/scale': P('pp', None),
  'layers/mlp_norm/scale': P('pp', None),
  'layers/qkv/kernel': P('pp', None, 'tp', None, None),  # column-parallel, by KV head
  'layers/o/kernel': P('pp', 'tp', None, None),  # row-parallel
  'layers/gate_up/kernel': P('pp', None, None, 'tp'),  # column-parallel
  'layers/down/kernel': P('pp', 'tp', None),  # row-parallel
}


def tiny_setup(**over):
  cfg = config_lib.load_config('tiny', over)
  return assemble.build(cfg, jax.devices())


def test_partition_spec_of_every_parameter():
  s = tiny_setup()
  flat = jax.tree_util.tree_flatten_with_path(s.param_shardings)[0]
  got = {'/'.join(k.key for k in path): sh.spec for path, sh in flat}
  assert got == EXPECTED
  shapes = jax.eval_shape(lambda: model_lib.init_params(jax.random.key(0), s.dims, s.layer_order))
  assert shapes['layers']['qkv']['kernel'].shape == (4, 256, 2, 4, 64)  # [L, d, k, g+2, h]
  assert shapes['layers']['gate_up']['kernel'].shape == (4, 256, 2, 768)


def _collectives(hlo: str) -> dict:
  names = ('all-reduce', 'all-gather', 'reduce-scatter', 'collective-permute', 'all-to-all')
  return {n: len(re.findall(rf'= [^=]*? {n}(?:-start)?\(', hlo)) for n in names}


def test_one_layer_forward_has_exactly_the_megatron_all_reduces():
  """dp=4 x tp=2: the forward pass of one Block compiles to one all-reduce after attention and
  one after the MLP, and no other collective."""
  s = tiny_setup(**{'mesh.dp': 4, 'mesh.pp': 1, 'mesh.tp': 2, 'pipeline.microbatches': 1})
  sh = s.param_shardings
  layer_sh = jax.tree.map(lambda x: NamedSharding(s.mesh, P(*x.spec[1:])), sh['layers'])
  shapes = jax.eval_shape(lambda: model_lib.init_params(jax.random.key(0), s.dims, s.layer_order))
  layer = jax.tree.map(
    lambda a, sh_: jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=sh_), shapes['layers'], layer_sh
  )
  x = jax.ShapeDtypeStruct((8, 128, 256), jnp.float32, sharding=NamedSharding(s.mesh, P('dp')))

  def fwd(p, x):
    with sharding.use_rules(s.rules):
      return model_lib.block_apply(s.dims, p, x)

  with jax.set_mesh(s.mesh):
    hlo = jax.jit(fwd).lower(layer, x).compile().as_text()
  counts = _collectives(hlo)
  assert counts == {
    'all-reduce': 2,
    'all-gather': 0,
    'reduce-scatter': 0,
    'collective-permute': 0,
    'all-to-all': 0,
  }, counts
  lines = re.findall(r'all-reduce(?:-start)?\([^\n]*', hlo)
  assert len(lines) == 2
  # Both over exactly the tp groups of the mesh (positions in its device order): the pairs of
  # devices that differ only in their tp coordinate.
  shape = s.mesh.devices.shape
  tp_groups = sorted(np.arange(s.mesh.devices.size).reshape(-1, shape[-1]).tolist())
  for line in lines:
    groups = hlo_lib.replica_groups(line, s.mesh.devices.size)
    assert sorted(sorted(g) for g in groups) == tp_groups, line
    assert hlo_lib.group_axes(groups, shape) == 'tp'
