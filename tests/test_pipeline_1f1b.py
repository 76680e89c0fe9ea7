"""The 1F1B schedule (pipeline.schedule='1f1b'): its timetable (jax3d/parallel/pipeline/timetable.py)
and the loop with the loss inside it (one_f_one_b.py) against a plain scan over the same layers and
loss, value and gradients (layers, head, input), for p in {2, 4, 8}, m in {p, 2p, 4p}, v in {1, 2},
remat none / full / dots."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_equivalence as equivalence
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from test_pipeline import D, close, layer_fn, make

from jax3d.parallel import pipeline, placement
from jax3d.parallel.pipeline import chunk, timetable

V = 5  # the toy head's vocabulary
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_timetable_and_the_planner_import_no_jax():
  """timetable.py is numpy only: importing it (its package's __init__.py runs first) and the memory
  model that reads it loads no jax."""
  code = (
    'import sys, jax3d.parallel.pipeline.timetable, jax3d.planning.memory_model\n'
    "loaded = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.'))\n"
    'assert not loaded, loaded[:3]'
  )
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]))
  r = subprocess.run(
    [sys.executable, '-c', code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
  )
  assert r.returncode == 0, r.stderr


def head_loss(hd, y_btd, side):
  """A toy head and weighted cross-entropy: the loss of one micro-batch from its side inputs."""
  logits = jnp.tanh(y_btd) @ hd['out']
  lse = jax.nn.logsumexp(logits, axis=-1)
  target = jnp.take_along_axis(logits, side['targets'][..., None], axis=-1)[..., 0]
  return jnp.sum((lse - target) * side['weights'])


def inputs(p, m, v, seed=0):
  layers, x = make(p, m, v, seed)
  k = jax.random.split(jax.random.key(seed + 1), 3)
  head = {'out': jax.random.normal(k[0], (D, V)) / D**0.5}
  side = {
    'targets': jax.random.randint(k[1], x.shape[:3], 0, V),
    'weights': jax.random.uniform(k[2], x.shape[:3]),
  }
  return layers, head, x, side


def sequential_loss(layers, head, x_mbtd, side):
  y = jax.vmap(lambda x: chunk.run_layers(layer_fn, layers, x, 'none'))(x_mbtd)
  return sum(head_loss(head, y[i], {k: a[i] for k, a in side.items()}) for i in range(x_mbtd.shape[0]))


def check(p, m, v, policy, skip, dp=None):
  """`dp` (default 8/p) sets a micro-batch's rows per device, B/dp, and so how the head splits
  over pp: by rows where they divide by p, else by positions (T = 4), else not (p = 8)."""
  dp = dp or 8 // p
  devices = np.array(jax.devices()[: p * dp]).reshape(dp, p, 1)
  mesh = Mesh(devices, ('dp', 'pp', 'tp'), axis_types=(AxisType.Auto,) * 3)
  layers, head, x, side = inputs(p, m, v)
  L = layers['w1'].shape[0]
  stored = jax.device_put(placement.from_canonical(layers, L, p, v), NamedSharding(mesh, P('pp')))

  def piped(stored, head, x):
    return pipeline.run_loss(
      layer_fn, stored, head, x, side, head_loss, mesh=mesh, repeats=v, policy=policy, skip_bubbles=skip
    )

  grad = jax.value_and_grad(piped, argnums=(0, 1, 2))
  with jax.set_mesh(mesh):
    loss, (g_layers, g_head, g_x) = jax.jit(lambda s, h, x: grad(s, h, x))(stored, head, x)
    loss_only = jax.jit(piped)(stored, head, x)
  ref = jax.jit(jax.value_and_grad(sequential_loss, argnums=(0, 1, 2)))
  r_loss, (r_layers, r_head, r_x) = ref(layers, head, x, side)
  close(loss, r_loss)
  close(loss_only, r_loss)
  jax.tree.map(close, placement.to_canonical(g_layers, L, p, v), r_layers)
  jax.tree.map(close, g_head, r_head)
  close(g_x, r_x)


FAST = [
  pytest.param(2, 4, 1, 'none', True, marks=pytest.mark.slow),
  (4, 4, 2, 'full', True),
  pytest.param(2, 2, 2, 'dots', False, marks=pytest.mark.slow),
]
# Every (p, m, v) once, the policy cycling so that each (p, v) meets all three and each (p, m) two
# (the full product, 54 compiles, was a fifth of the slow suite's time for no pair it adds).
MATRIX = [
  (p, m, v, ('none', 'full', 'dots')[(j + v) % 3])
  for p in (2, 4, 8)
  for j, m in enumerate((p, 2 * p, 4 * p))
  for v in (1, 2)
]


@pytest.mark.parametrize('p,m,v,policy,skip', FAST)
def test_1f1b_equals_plain_scan(p, m, v, policy, skip):
  check(p, m, v, policy, skip)


def test_1f1b_head_that_cannot_split_counts_the_loss_once():
  """The default suite's case of a head whole on every stage (p = 3 divides neither the 4 rows nor
  the 4 positions of a micro-batch): the loss equals the plain scan's, so it is counted on the last
  stage alone (on every stage it would be 3 times the reference). The loss alone, to stay cheap:
  -m slow checks the gradients of the whole head too (test_1f1b_head_split_equals_plain_scan)."""
  p, m = 3, 3
  mesh = Mesh(
    np.array(jax.devices()[:p]).reshape(1, p, 1), ('dp', 'pp', 'tp'), axis_types=(AxisType.Auto,) * 3
  )
  layers, head, x, side = inputs(p, m, 1)
  stored = jax.device_put(
    placement.from_canonical(layers, layers['w1'].shape[0], p, 1), NamedSharding(mesh, P('pp'))
  )
  piped = lambda s, h, x: pipeline.run_loss(
    layer_fn, s, h, x, side, head_loss, mesh=mesh, repeats=1, policy='none', skip_bubbles=False
  )
  with jax.set_mesh(mesh):
    loss = jax.jit(piped)(stored, head, x)
  close(loss, sequential_loss(layers, head, x, side))


# slow (10 s each): the default train-step test below splits its head by rows (2 per micro-batch, pp=2)
@pytest.mark.slow
@pytest.mark.parametrize('p,dp', [(2, 1), (8, 1)], ids=['rows', 'whole'])
def test_1f1b_head_split_equals_plain_scan(p, dp):
  """The head over pp by a micro-batch's rows (B = 4 on one dp rank, p = 2), or, where neither rows
  nor positions divide (p = 8), whole on every stage and counted on the last."""
  check(p, 2 * p, 1, 'none', False, dp=dp)


@pytest.mark.slow
@pytest.mark.parametrize('p,m,v,policy', MATRIX)
def test_1f1b_matrix_equals_plain_scan(p, m, v, policy):
  check(p, m, v, policy, skip=(p + m + v) % 2 == 0)


@pytest.mark.parametrize('v', [1, 2, 3])
@pytest.mark.parametrize('p', [2, 4, 8])
def test_residuals_are_bounded_by_the_stages_not_the_microbatches(p, v):
  """Residual slots (units forwarded, not yet backwarded): min((v+1)p - 1, v*m) measured, whatever
  m beyond; one stash and one gradient slot; the tick count v*m + 2p - 1 + (v-1)p; every unit's
  forward before its backward, each exactly once; the head in m ticks, forwards and backwards
  each in GPipe's v*m + p - 1 ticks (what the accelerator path computes)."""
  for m in (p, 2 * p, 4 * p):
    s = timetable.build(p, v, m)
    assert s.residuals == timetable.residual_slots(p, v, m) == min((v + 1) * p - 1, v * m)
    assert s.stash == s.grads == 1
    assert s.ticks == timetable.ticks(p, v, m) == v * m + 2 * p - 1 + (v - 1) * p
    t, col = s.table, timetable.COL
    assert t[:, :, col['b_valid']].sum() == t[:, :, col['f_valid']].sum() == v * p * m
    for st in range(p):
      fw = [
        (t[n, st, col['f_mb']], t[n, st, col['f_chunk']], n) for n in np.nonzero(t[:, st, col['f_valid']])[0]
      ]
      bw = {
        (t[n, st, col['b_mb']], t[n, st, col['b_chunk']]): n for n in np.nonzero(t[:, st, col['b_valid']])[0]
      }
      assert len(fw) == len(bw) == v * m and all(bw[(i, r)] > n for i, r, n in fw)
    f, b, h = s.phases.sum(axis=0)
    assert (f, b, h) == (v * m + p - 1, v * m + p - 1, m)


# End to end: the train step under 1F1B (the head and loss in the loop) against one device.
ONE_F = {'pipeline__schedule': '1f1b'}


@pytest.mark.parametrize(
  'over',
  [
    pytest.param({'mesh__dp': 2, 'mesh__pp': 2, 'mesh__tp': 2, 'pipeline__microbatches': 8}, id='2-2-2-m8'),
    pytest.param(
      {'mesh__dp': 1, 'mesh__pp': 2, 'mesh__tp': 4, 'pipeline__microbatches': 4, 'pipeline__repeats': 2},
      id='1-2-4-v2-m4',
      marks=pytest.mark.slow,
    ),
  ],
)
@pytest.mark.parametrize(
  'extra',
  [
    pytest.param({}, id='plain'),
    pytest.param({'train__grad_accum': 2}, id='accum', marks=pytest.mark.slow),
    pytest.param({'train__shard_optimizer': True}, id='zero1', marks=pytest.mark.slow),
    pytest.param({'train__sequence_parallel': 'true'}, id='sp', marks=pytest.mark.slow),
    pytest.param(
      {'train__remat': 'full', 'pipeline__skip_bubbles': 'false'}, id='full-computed', marks=pytest.mark.slow
    ),
  ],
)
def test_1f1b_train_step_equals_one_device(over, extra):
  equivalence.check({**over, **extra, **ONE_F})


@pytest.mark.slow
def test_1f1b_tied_embeddings_and_loss_chunks_equal_one_device():
  """The tied table read by the head inside the loop (its gradient there and from the embedding
  outside summed), the head's positions in loss-chunk pieces (2 sequences per micro-batch on 2x2x2:
  the head splits the positions over pp)."""
  tied = {'model__tie_embeddings': True}
  over = {'mesh__dp': 2, 'mesh__pp': 2, 'mesh__tp': 2, 'pipeline__microbatches': 4, 'train__loss_chunks': 2}
  equivalence.check({**over, **tied, **ONE_F}, tuple(tied.items()))


@pytest.mark.slow
def test_1f1b_bf16_compute_equals_one_device():
  """bf16 compute, fp32 weights: the chunk's weights cast before the VJP (chunk.Chunk.weights)."""
  bf16 = {'train__compute_dtype': 'bfloat16'}
  over = {'mesh__dp': 2, 'mesh__pp': 2, 'mesh__tp': 2, 'pipeline__microbatches': 4}
  equivalence.check_bf16({**over, **bf16, **ONE_F}, tuple(bf16.items()))


# The cost model, planner and OOM ladder know the schedule (nothing compiles).
def _estimate(m, schedule, **over):
  from jax3d import config
  from jax3d.planning import costmodel

  over = {'mesh.dp': 1, 'mesh.pp': 4, 'mesh.tp': 2, 'train.global_batch_size': 2 * m, **over}
  cfg = config.load_config('tiny', {**over, 'pipeline.microbatches': m, 'pipeline.schedule': schedule})
  return costmodel.estimate(cfg, config.validate(cfg, 8), 1e12, costmodel.Hardware(flash_attention=False))


def test_cost_model_activations_flat_in_m_under_1f1b():
  """GPipe's activations grow with m (every iteration's residuals); 1F1B's residual slots stop
  growing at m = 2p (only the loop's own input and its gradient, 2 m micro-batches of fp32, grow)."""
  acts = {s: [_estimate(m, s).breakdown['activations'] for m in (8, 32)] for s in ('gpipe', '1f1b')}
  assert acts['gpipe'][1] > 2.4 * acts['gpipe'][0]  # (32+3)/(8+3) iterations
  assert acts['1f1b'][1] < 1.35 * acts['1f1b'][0] and acts['1f1b'][1] < acts['gpipe'][1] / 3
  e = _estimate(16, '1f1b')
  assert e.schedule == '1f1b' and e.bubble == pytest.approx(3 / 19)  # GPipe's: forwards in m+p-1 ticks


@pytest.mark.slow
def test_planner_searches_1f1b_and_the_ladder_offers_it():
  from jax3d import config
  from jax3d.planning import costmodel, oom, planner

  cfg = config.load_config('tiny', {'train.remat': 'none'})
  plan = config.validate(cfg, 8)
  gpipe = costmodel.estimate(cfg, plan, None, costmodel.Hardware(flash_attention=False))
  # a device just too small for GPipe's step: the planner's pick is a 1F1B layout that fits
  hw = costmodel.Hardware(
    nodes=1, gpus_per_node=8, memory_gb=gpipe.total_bytes * 0.6 / 1e9, flash_attention=False
  )
  ranked = planner.search(cfg, hw, policies=('none',), zero=('off',))
  assert {c.overrides['pipeline.schedule'] for c in ranked if c.plan.pp > 1} >= {'gpipe', '1f1b'}
  fits = [c for c in ranked if c.est.fits and c.plan.pp > 1]
  assert fits and fits[0].overrides['pipeline.schedule'] == '1f1b', [c.overrides for c in fits[:3]]
  hw = costmodel.Hardware(nodes=1, gpus_per_node=8, memory_gb=80, flash_attention=False)
  # a device just too small for GPipe's step: the ladder prices the 1F1B rung, and it fits
  lines = oom.oom_ladder(cfg, plan, gpipe.total_bytes * 0.999, hw)
  rung = next(line for line in lines if line.startswith('4b.'))
  assert '--config.pipeline.schedule=1f1b' in rung and 'FITS' in rung
  one_f = planner.with_overrides(cfg, {'pipeline.schedule': '1f1b'})
  rung = next(x for x in oom.oom_ladder(one_f, plan, 1e6, hw) if x.startswith('4b.'))
  assert 'more micro-batches cost no activation memory under 1f1b' in rung
