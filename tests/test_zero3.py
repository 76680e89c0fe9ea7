"""ZeRO-3 (train.shard_params): the parameters, their gradients and Adam's moments stored sharded
over dp, gathered per layer inside the pipeline loop ('layer') or once per step ('step'). The
numbers equal one device (losses and step-1 gradients, rtol 1e-5) on every layout and schedule,
with gradient accumulation and the int8 reduction; the state really is 1/dp per device; and a
checkpoint moves between shard_params on and off exactly."""

import os
import re
import shutil

import chex
import jax
import numpy as np
import pytest
from test_checkpoint import canonical_state, cfg_for, losses
from test_equivalence import check, check_bf16

import jax3d
from jax3d import config as config_lib, step as step_lib
from jax3d.trainer import metrics
from jax3d.trainer.trainer import Trainer

from helpers import run_steps, setup_for, small_cfg

Z3 = {'train__shard_params': True}
LAYOUTS = {
  '8-1-1': {'mesh__dp': 8},
  '4-1-2': {'mesh__dp': 4, 'mesh__tp': 2},
  '2-2-2-m2': {'mesh__dp': 2, 'mesh__pp': 2, 'mesh__tp': 2, 'pipeline__microbatches': 2},
  '2-4-1-m4': {'mesh__dp': 2, 'mesh__pp': 4, 'pipeline__microbatches': 4},
}
FAST = {('8-1-1', 'layer'), ('2-2-2-m2', 'layer')}
# The other combinations: (4-1-2, step) with accumulation and int8, (2-4-1, layer) with 1F1B and
# accumulation, (2-2-2, step) under stage remat below
SLOW = {('4-1-2', 'layer'), ('8-1-1', 'step'), ('2-4-1-m4', 'step')}


@pytest.mark.parametrize(
  'name,mode',
  [
    pytest.param(n, g, marks=() if (n, g) in FAST else pytest.mark.slow)
    for n in LAYOUTS
    for g in ('layer', 'step')
    if (n, g) in FAST | SLOW
  ],
)
def test_shard_params_equal_one_device(name, mode):
  check({**LAYOUTS[name], **Z3, 'train__shard_params_gather': mode})


@pytest.mark.parametrize(
  'name,over',
  [
    pytest.param('2-4-1-m4', {'train__grad_accum': 2}, marks=pytest.mark.slow),
    pytest.param(
      '4-1-2', {'train__grad_accum': 2, 'train__shard_params_gather': 'step'}, marks=pytest.mark.slow
    ),
    pytest.param('2-4-1-m4', {'pipeline__schedule': '1f1b', 'train__remat': 'full'}, marks=pytest.mark.slow),
    pytest.param(
      '2-2-2-m2',
      {
        'pipeline__microbatches': 4,
        'pipeline__repeats': 2,
        'train__remat': 'stage',
        'train__shard_params_gather': 'step',
      },
      marks=pytest.mark.slow,
    ),
    # sequence parallelism under remat 'none': the layer's checkpoint keeps what 'dots' keeps
    pytest.param('4-1-2', {'train__sequence_parallel': 'true'}, marks=pytest.mark.slow),
  ],
)
def test_shard_params_with_accumulation_schedules_and_remat(name, over):
  check({**LAYOUTS[name], **Z3, **over})


@pytest.mark.slow
@pytest.mark.parametrize('name', ['4-1-2'])
def test_shard_params_with_the_int8_reduction(name):
  """int8 rounds the gradients, so the reference is ZeRO-1 with int8 on the same layout (the same
  reduce-scatter of the same quantised chunks): equal within 1e-5, losses and parameters after 3
  steps; and within int8's rounding of one device (rtol 1e-3, as the int8 tests elsewhere)."""
  int8 = {**LAYOUTS[name], 'train__grad_reduce_dtype': 'int8', 'train__grad_accum': 2}
  losses3, _, _ = run_steps(small_cfg(**int8, **Z3))
  zero1, _, _ = run_steps(small_cfg(**int8, train__shard_optimizer=True))
  one, _, _ = run_steps(small_cfg())
  np.testing.assert_allclose(losses3, zero1, rtol=1e-5)
  np.testing.assert_allclose(losses3, one, rtol=1e-3)
  assert losses3[2] < losses3[0]


def _state_bytes(s) -> int:
  """Bytes of the train state one device holds, from the state's shardings."""
  leaves = jax.tree.leaves(s.abstract_state)
  return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize for a in leaves)


def test_state_is_stored_sharded_over_dp():
  """Every parameter, and Adam's two moments, is stored with dp on one dimension (never the layer
  axis), so the state per device is 1/dp of the replicated one; the stacked layers' dp slices feed
  the pipeline loop, which gathers them."""
  cfg = lambda **o: small_cfg(**LAYOUTS['2-2-2-m2'], **o)
  s_off, s_on = setup_for(cfg()), setup_for(cfg(**Z3))
  assert s_on.zero3 and s_on.zero1 and not s_on.explicit_dp and s_on.gather.mode == 'layer'
  flat = jax.tree_util.tree_flatten_with_path(s_on.param_shardings)[0]
  for path, sh in flat:
    spec = tuple(sh.spec)
    assert 'dp' in spec, (path, spec)
    if path[0].key == 'layers':
      assert spec[0] == 'pp', (path, spec)
  assert _state_bytes(s_on) == pytest.approx(_state_bytes(s_off) / 2, rel=0.01)
  # without pp (the layer axis is pp's, of size 1) a dp shard is still a slice of every layer, so
  # the loop can gather one layer at a time
  s8 = setup_for(small_cfg(**LAYOUTS['8-1-1'], **Z3))
  for path, sh in jax.tree_util.tree_flatten_with_path(s8.param_shardings['layers'])[0]:
    assert tuple(sh.spec)[0] == 'pp' and 'dp' in tuple(sh.spec), (path, sh.spec)
  assert all(k >= 1 for k in jax.tree.leaves(s8.gather.dims))
  line = next(x for x in metrics.summary_lines(s8, '') if 'parameters per device' in x)
  assert '176.5 KiB' in line and 'sharded over dp=8' in line and 'ZeRO-3: each layer gathered' in line, line
  # the compute layout is the one without ZeRO-3
  assert jax.tree.map(lambda a: a.spec, s_on.compute_shardings) == jax.tree.map(
    lambda a: a.spec, s_off.param_shardings
  )


def test_compiled_state_and_gather_memory():
  """dp=8 on a model whose weights dominate: the compiled step's arguments (state + batch) fall to
  about 1/8 with shard_params, and 'layer' holds less temporary memory than 'step' (one layer's
  weights and gradient whole at a time instead of all of them)."""
  big = {'model__d_model': 256, 'model__d_ff': 1024, 'model__n_layers': 4, 'train__global_batch_size': 8}
  cfg = lambda **o: small_cfg(mesh__dp=8, **big, **o)
  off = jax3d.compiled_memory(cfg())
  layer = jax3d.compiled_memory(cfg(**Z3, train__shard_params_gather='layer'))
  step = jax3d.compiled_memory(cfg(**Z3, train__shard_params_gather='step'))
  assert layer['argument'] < 0.2 * off['argument'], (layer, off)
  assert layer['total'] < 0.5 * off['total'], (layer, off)
  layer_weights = 4 * (4 * 256 * 256 + 3 * 256 * 1024)  # fp32, one layer
  assert step['temp'] - layer['temp'] > 2 * layer_weights, (step, layer)
  # and less than half the replicated step's temporaries (measured 10.5 against 33.0 MiB; with
  # every layer's gather hoisted out of the micro-batch scan, as JAX does without the barrier in
  # zero3.Gather.layer, 23.6)
  assert layer['temp'] < 0.5 * off['temp'], (layer, off)


def test_bf16_compute_gathers_the_matmul_weights_in_bf16():
  """fp32 weights, bf16 compute, ZeRO-3 per layer under remat full: every gather of a layer's
  matrices (forward and the backward's recompute) moves bf16, cast before the gather (its bits as
  uint16), and each weight gradient is still reduce-scattered in fp32, so the numbers are those
  of one device in bf16 (test_equivalence.check_bf16's bounds)."""
  bf16 = {'train__compute_dtype': 'bfloat16', 'train__remat': 'full'}
  over = {'mesh__dp': 4, 'mesh__tp': 2, **Z3, 'train__shard_params_gather': 'layer', **bf16}
  check_bf16(over, bf16)
  s = setup_for(small_cfg(**over))
  # The program as jax3d writes it (the compiled one holds the same uint16 gathers on every platform)
  text = step_lib.make_train_step(s).lower(s.abstract_state, s.abstract_batch).as_text()
  d, f = s.dims.d_model, s.dims.d_ff // 2  # the MLP's hidden size on one of tp=2
  gathers = re.findall(r'all_gather.*?-> tensor<([\dx]+)x(\w+)>', text)
  scatters = re.findall(r'reduce_scatter.*?\}\) : \(tensor<[^>]*>\) -> tensor<([\dx]+)x(\w+)>', text, re.S)
  down = [t for shape, t in gathers if shape == f'{f}x{d}']  # the down projection, gathered whole
  assert len(down) >= 2 and set(down) == {'ui16'}, gathers  # the forward's and the recompute's, bf16 bits
  assert scatters and {t for _, t in scatters} == {'f32'}, scatters


@pytest.mark.slow
@pytest.mark.parametrize('first,then,target', [(True, False, (2, 2, 2, 2)), (False, True, (4, 1, 2, 1))])
def test_resume_across_shard_params(tmp_path, first, then, target):
  """A checkpoint saved with shard_params on resumes with it off on the same layout, and one saved
  without it resumes with it on another layout: every restored array bit-identical to the saved
  state, in the new run's shardings, and the next step's loss that of the uninterrupted run."""
  src = Trainer(cfg_for(2, 2, 2, m=2, train__shard_params=first), workdir=str(tmp_path), console=False)
  src.train(steps=3)
  saved = canonical_state(src)
  src.train(steps=1)
  ref_loss = losses(str(tmp_path))[4]
  src.close()
  os.remove(str(tmp_path / 'metrics.jsonl'))
  shutil.rmtree(str(tmp_path / 'checkpoints' / '4'))
  dst = Trainer(
    cfg_for(*target[:3], m=target[3], train__shard_params=then), workdir=str(tmp_path), console=False
  )
  assert 'resumed' in dst.init_state()
  chex.assert_trees_all_equal(canonical_state(dst), saved)
  for arr, sh in zip(jax.tree.leaves(dst.state), jax.tree.leaves(dst.setup.state_shardings), strict=True):
    assert arr.sharding.is_equivalent_to(sh, arr.ndim)
  dst.train(steps=1)
  np.testing.assert_allclose(losses(str(tmp_path))[4], ref_loss, rtol=1e-5)
  dst.close()


def test_bad_gather_settings_are_refused_before_compiling():
  with pytest.raises(
    config_lib.ConfigError,
    match=r"train\.shard_params_gather='per_layer' is invalid: one of auto, layer, step",
  ):
    config_lib.validate(small_cfg(train__shard_params_gather='per_layer'), 1)
  with pytest.raises(
    config_lib.ConfigError,
    match=r"train\.shard_params_gather='layer' is invalid: 'step' or 'auto' with train\.grad_reduce_dtype='int8'",
  ):
    config_lib.validate(
      small_cfg(**Z3, train__shard_params_gather='layer', train__grad_reduce_dtype='int8'), 1
    )
  # 'auto' resolves to 'step' on the explicit path, 'layer' elsewhere; dp=1 has nothing to shard
  assert setup_for(small_cfg(mesh__dp=2, **Z3, train__grad_reduce_dtype='int8')).gather.mode == 'step'
  s1 = setup_for(small_cfg(**Z3))
  assert not s1.zero3 and s1.gather is None


@pytest.mark.slow
def test_a_model_that_fits_only_with_shard_params(tmp_path):
  """hardware.memory_gb between the two compiled figures, dp=8: without shard_params the trainer
  refuses before the first step (exit 2's ConfigError, the ladder naming ZeRO-3), with it the run
  trains. 8 layers of d_model 512: 33.6M fp32 parameters, 0.40 GB of state per device replicated."""
  big = {
    'mesh.dp': 8,
    'mesh.pp': 1,
    'mesh.tp': 1,
    'pipeline.microbatches': 1,
    'model.d_model': 512,
    'model.d_ff': 2048,
    'model.n_layers': 8,
    'model.n_heads': 8,
    'model.n_kv_heads': 8,
    'train.seq_len': 64,
    'train.remat': 'full',
    'hardware.memory_gb': 0.3,
    'log.every': 1,
    'log.progress': False,
  }
  refused = Trainer(config_lib.load_config('tiny', big), workdir=str(tmp_path / 'off'), console=False)
  with pytest.raises(config_lib.ConfigError, match=r'hardware\.memory_gb=0\.3 allows.*ZeRO-3'):
    refused.compile()
  refused.close()
  on = config_lib.load_config('tiny', {**big, 'train.shard_params': True})
  t = Trainer(on, workdir=str(tmp_path / 'on'), console=False)
  t.train(steps=2)
  assert set(losses(str(tmp_path / 'on'))) == {1, 2}
  t.close()
