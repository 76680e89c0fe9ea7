"""Each feature against an independent reference, so that removing it fails a default-suite test
(issue 35): bf16 compute against float32, the int8 error feedback against plain int8 and the exact
sum, remat `dots` against `none` (memory and recomputed FLOPs), a NaN gradient beside a finite loss,
and the leak detector inside a real training run. (A real ENOSPC during an asynchronous save:
tests/test_disk_full.py.)"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from test_checkpoint import cfg_for

from jax3d import assemble, step as step_lib
from jax3d.parallel import compression
from jax3d.trainer.trainer import Trainer

from helpers import run_steps, setup_for, small_cfg

TWO_LAYERS = {'model__n_layers': 2}


# ---------------------------------------------------------------------------------------- bf16 compute
def dot_dtypes(s) -> list[str]:
  """The operand element types of every dot_general in the lowered train step (StableHLO; XLA:CPU's
  compiled HLO upcasts bf16 dots to f32, so the lowered program is where the choice shows)."""
  text = step_lib.make_train_step(s).lower(s.abstract_state, s.abstract_batch).as_text()
  return re.findall(r'stablehlo\.dot_general .*?: \(tensor<(?:\d+x)*(\w+)>', text)


def test_bf16_compute_runs_in_bf16_and_stays_near_float32():
  """train.compute_dtype=bfloat16: the layers' matmuls take bf16 operands (float32 has none), and the
  first losses differ from float32's by more than float32's own noise (the computation really
  changed) and by less than bf16's rounding allows (relative 1e-2: bf16 keeps 8 bits, 2^-8 = 0.4%
  per rounding, averaged over the token losses)."""
  f32, bf16 = (small_cfg(train__compute_dtype=d, **TWO_LAYERS) for d in ('float32', 'bfloat16'))
  d32, d16 = dot_dtypes(setup_for(f32)), dot_dtypes(setup_for(bf16))
  assert d32 and 'bf16' not in d32, d32
  assert d16.count('bf16') >= 6, d16  # q/k/v/o, gate_up, down: forward and backward
  l32, l16 = run_steps(f32, 2)[0], run_steps(bf16, 2)[0]
  gap = np.abs(l16 - l32) / l32
  assert np.all(gap > 1e-5), (l32, l16)
  assert np.all(gap < 1e-2), (l32, l16)


# ---------------------------------------------------------------------------------------- int8 feedback
def int8_reduce_fn(mesh):
  """compression.reduce with int8 over all of `mesh`'s n ranks (dp, or dp and cp together as
  context parallelism reduces), for one [rows, cols] leaf (zero_dim 0): per-rank gradients in
  ([n, rows, cols], rank-major), the residual [rows, cols, n]; the full sum and the new residual out."""
  axes = mesh.axis_names

  def local(g, r):
    red, nr = compression.reduce({'w': g[0]}, {'w': r}, {'w': 0}, 'int8', mesh.size, False, axes)
    return red['w'], nr['w']

  return jax.jit(
    jax.shard_map(
      local, mesh=mesh, in_specs=(P(axes), P(None, None, axes)), out_specs=(P(), P(None, None, axes))
    )
  )


@pytest.mark.parametrize('shape,names', [((2,), ('dp',)), ((2, 2), ('dp', 'cp'))], ids=['dp2', 'dp2-cp2'])
def test_int8_error_feedback_bounds_the_accumulated_error(shape, names):
  """The same per-rank gradients for 64 steps: with error feedback the delivered total stays within
  two int8 steps (absmax / 127) of the exact sum, while plain int8 (each step quantised alone, as
  compression.quantize does it, no residual) drifts by a multiple of that; one step alone already
  loses something (the quantisation is real). Over dp, and over dp x cp (context parallelism: each
  rank owns its slice of the residual by its index over both axes)."""
  mesh = jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])
  n = mesh.size
  reduce_fn = int8_reduce_fn(mesh)
  rng = np.random.default_rng(0)
  g = rng.standard_normal((n, 64, 512)).astype(np.float32)
  g[:, :, ::37] *= 20  # outliers: large scales, so small entries round badly
  exact = g.astype(np.float64).sum(0)
  r = jax.device_put(jnp.zeros((64, 512, n), jnp.float32), NamedSharding(mesh, P(None, None, names)))
  g_dev = jax.device_put(g, NamedSharding(mesh, P(names)))
  step_q = np.abs(g).max() / 127  # one int8 step at the largest scale
  delivered, first_err = np.zeros_like(exact), None
  steps = 64
  for t in range(steps):
    out, r = reduce_fn(g_dev, r)
    delivered += np.asarray(out, np.float64)
    if t == 0:
      first_err = np.abs(delivered - exact).max()
  fed_err = np.abs(delivered - steps * exact).max()
  q, scale, _, restore = compression.quantize(jnp.asarray(g.reshape(n * 64, 512)), None)
  plain = np.asarray(restore(q.astype(jnp.float32) * scale), np.float64).reshape(n, 64, 512).sum(0)
  plain_err = steps * np.abs(plain - exact).max()
  assert first_err > 0.05 * step_q, (first_err, step_q)
  assert fed_err < 2 * step_q, (fed_err, step_q)
  assert plain_err > 10 * step_q, (plain_err, step_q)


# ---------------------------------------------------------------------------------------- remat dots
def test_remat_dots_saves_memory_by_recomputing():
  """train.remat=dots against none: XLA's temporary memory per device at least 20% lower (measured
  40%: the layers' non-matmul activations are not kept), and more FLOPs in the compiled step (what
  is recomputed in the backward pass)."""
  ov = dict(TWO_LAYERS, train__seq_len=64, model__d_model=128, model__d_ff=512)
  none, dots = (
    assemble.compile_train_step(setup_for(small_cfg(train__remat=r, **ov))) for r in ('none', 'dots')
  )
  assert dots.memory['temp'] < 0.8 * none.memory['temp'], (dots.memory, none.memory)
  assert dots.analysis()['flops'] > none.analysis()['flops'], (
    dots.analysis()['flops'],
    none.analysis()['flops'],
  )


# ---------------------------------------------------------------------------------------- NaN gradient
def test_nan_gradient_with_a_finite_loss_is_skipped_and_counted(monkeypatch):
  """The drill at step 2 with the loss left finite (NaN in the gradients only, as an overflow in the
  backward pass gives): the trainer counts a non-finite step with a finite loss, and the parameters
  after it are those after step 1; step 3 trains again."""
  drill = step_lib._fault_drill  # the library's drill, with its NaN loss dropped: gradients only
  monkeypatch.setattr(
    step_lib, '_fault_drill', lambda step, loss, grads, steps: (loss, drill(step, loss, grads, steps)[1])
  )
  t = Trainer(cfg_for(1, 1, 1, train__inject_nan_at='2'), devices=jax.devices()[:1], console=False)
  t.train(steps=1)
  after1 = jax.device_get(t.state['params'])
  recs = t.train(steps=1)
  bad = [r for r in recs if r.get('event') == 'nonfinite']
  assert len(bad) == 1 and bad[0]['step'] == 2 and bad[0]['consecutive'] == 1, recs
  # a non-finite number is recorded as null (JSON has no NaN)
  assert np.isfinite(bad[0]['loss']) and bad[0]['grad_norm'] is None, bad
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(t.state['params']), after1)
  recs = t.train(steps=1)
  assert t.steplog.bad == 0 and np.isfinite([r['loss'] for r in recs if 'loss' in r]).all()
  same = jax.tree.map(np.array_equal, jax.device_get(t.state['params']), after1)
  assert not any(jax.tree.leaves(same))
  t.close()


# ---------------------------------------------------------------------------------------- leak detector
@pytest.mark.parametrize('leak_mb', [0, 2])
def test_leak_detector_in_a_training_run(leak_mb):
  """A real run with the detector over 6 logged steps (threshold 0.5 MB/step): silent while the
  memory is flat; with 2 MB of device arrays kept alive after every step (a Python list of step
  outputs, the classic leak), one 'memory_leak' record naming device 0 and about 2 MB/step."""
  cfg = cfg_for(1, 1, 1, log__leak_window=6, log__leak_mb_per_step=0.5)
  t = Trainer(cfg, devices=jax.devices()[:1], console=False)
  kept, recs = [], []
  for _ in range(8):
    recs += t.train(steps=1)
    if leak_mb:
      kept.append(jax.device_put(np.ones(leak_mb * 2**18, np.float32), t.devices[0]))
  t.close()
  leaks = [r for r in recs if r.get('event') == 'memory_leak']
  if not leak_mb:
    assert leaks == [], leaks
    return
  assert len(leaks) == 1 and leaks[0]['devices'] == [0], leaks
  assert leak_mb * 0.9 < leaks[0]['slope_mb_per_step'] < leak_mb * 1.1, leaks
