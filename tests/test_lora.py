"""LoRA (jax3d/model/lora.py): adapters trained, the base frozen; every layout gives the one-device
losses and adapter gradients, from adapters whose B is not zero (so A gets a gradient too)."""

import chex
import jax
import numpy as np
import optax
import pytest
from test_documents import weighted_batches

from jax3d import assemble, step as step_lib
from jax3d.errors import ConfigError
from jax3d.model import lora
from jax3d.parallel import placement

from helpers import canonical, fixed_batches, setup_for, small_cfg

RTOL, ATOL = 1e-5, 1e-7
LORA = {'lora__rank': 4, 'lora__alpha': 8.0, 'model__n_layers': 4}


def with_nonzero_b(s, params, seed=1):
  """`params` with every adapter's B drawn from a normal(0.05), in canonical layer order (the same
  values on every layout), in the setup's shardings."""
  host = canonical(s, params)
  rng = np.random.default_rng(seed)
  host['layers'] = jax.tree_util.tree_map_with_path(
    lambda p, a: (0.05 * rng.standard_normal(a.shape)).astype(a.dtype) if p[-1].key == 'b' else a,
    host['layers'],
  )
  host['layers'] = placement.from_canonical(host['layers'], s.dims.n_layers, s.plan.pp, s.plan.repeats)
  return jax.device_put(host, s.param_shardings)


def run_lora(cfg, n_steps=3, batches=None, start=None):
  """Losses of n steps (on `batches`, or fixed ones), the step-1 adapter gradients (Adam's
  mu / (1 - b1)), the base before and after (canonical, on the host); from the seed's parameters
  with a non-zero B, or from `start` (host parameters of a one-device run, cast to cfg's dtypes)."""
  s = setup_for(cfg)
  if start is None:
    params = with_nonzero_b(s, step_lib.make_init(s)(cfg.train.seed)['params'])
  else:
    to = lambda a, t: jax.device_put(np.asarray(a).astype(t.dtype), t.sharding)
    params = jax.tree.map(to, start, s.abstract_state['params'])
  state = step_lib.make_init_from_params(s)(params)
  base0 = lora.split(canonical(s, state['params']), True)[1]
  train = assemble.compile_train_step(s)
  losses, grads = [], None
  for b in batches or fixed_batches(cfg, n_steps):
    state, m = train(state, {k: jax.device_put(v, s.batch_sharding) for k, v in b.items()})
    losses.append(float(m['loss']))
    if grads is None:
      mu = optax.tree.get(state['opt_state'], 'mu')
      grads = jax.tree.map(lambda x: x / (1 - cfg.train.b1), canonical(s, mu))
  return np.array(losses), grads, base0, lora.split(canonical(s, state['params']), True)[1]


_REF = {}


def reference(documents=False):
  if documents not in _REF:
    _REF[documents] = run_lora(small_cfg(**LORA), batches=weighted_batches() if documents else None)
  return _REF[documents]


def check(over, documents=False, rtol=RTOL, atol=ATOL, loss_rtol=RTOL):
  batches = weighted_batches() if documents else None
  losses, grads, base0, base1 = run_lora(small_cfg(**{**LORA, **over}), batches=batches)
  r_losses, r_grads, r_base0, _ = (
    reference(documents) if over.get('model__n_layers', 4) == 4 else reference8()
  )
  chex.assert_trees_all_close(base0, r_base0, rtol=0, atol=0)  # init is layout-independent
  chex.assert_trees_all_equal(base1, base0)  # the base is frozen: bit for bit
  np.testing.assert_allclose(losses, r_losses, rtol=loss_rtol)
  chex.assert_trees_all_close(grads, r_grads, rtol=rtol, atol=atol)
  assert all(lora.is_adapter(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0])
  assert documents or losses[2] < losses[0]


def reference8():
  if 8 not in _REF:
    _REF[8] = run_lora(small_cfg(**{**LORA, 'model__n_layers': 8}))
  return _REF[8]


@pytest.mark.slow  # default-suite budget (CI runs -m slow too)
def test_only_adapters_train_and_base_is_frozen():
  losses, grads, base0, base1 = reference()
  chex.assert_trees_all_equal(base1, base0)
  leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
  assert {p[-2].key for p, _ in leaves} == {f'lora_{t}' for t in lora.MODULES}
  # A gets a gradient because B starts non-zero, B because A does
  assert all(np.abs(g).max() > 0 for _, g in leaves)
  assert losses[2] < losses[0]


@pytest.mark.parametrize(
  'over',
  [
    # every layout under -m slow (default-suite budget); test_lora_peft's one-device case stays default
    pytest.param(
      {'mesh__dp': 2, 'mesh__pp': 2, 'mesh__tp': 2, 'pipeline__microbatches': 2}, marks=pytest.mark.slow
    ),
    pytest.param(
      {'mesh__pp': 2, 'mesh__tp': 4, 'pipeline__microbatches': 2, 'train__sequence_parallel': 'true'},
      marks=pytest.mark.slow,
    ),
    pytest.param(
      {
        'mesh__dp': 2,
        'mesh__pp': 2,
        'mesh__tp': 2,
        'pipeline__microbatches': 2,
        'pipeline__schedule': '1f1b',
        'train__shard_optimizer': True,
      },
      marks=pytest.mark.slow,  # default-suite budget (CI runs -m slow too)
    ),
    pytest.param({'mesh__dp': 2, 'mesh__cp': 4}, marks=pytest.mark.slow),  # context parallel (issue 43)
    pytest.param({'mesh__dp': 2, 'mesh__cp': 4, 'train__cp_strategy': 'ring'}, marks=pytest.mark.slow),
  ],
  ids=['2-2-2', '1-2-4-sp', '2-2-2-1f1b-zero1', 'dp2-cp4', 'dp2-cp4-ring'],
)
def test_layouts_equal_one_device(over):
  check(over)


D222 = {'mesh__dp': 2, 'mesh__pp': 2, 'mesh__tp': 2, 'pipeline__microbatches': 2}
VARIANTS = {
  'remat-full': {**D222, 'train__remat': 'full'},
  'remat-dots': {**D222, 'train__remat': 'dots'},
  'remat-attn': {**D222, 'train__remat': 'attn'},
  'remat-stage': {**D222, 'train__remat': 'stage'},
  'circular': {**D222, 'model__n_layers': 8, 'pipeline__repeats': 2},
  'zero3-layer': {**D222, 'train__shard_params': True, 'train__shard_params_gather': 'layer'},
  'zero3-step-bf16-wire': {**D222, 'train__shard_params': True, 'train__grad_reduce_dtype': 'bfloat16'},
  'loss-chunks-accum': {**D222, 'train__loss_chunks': 4, 'train__grad_accum': 2},
  'zero1-1f1b-interleaved': {
    **D222,
    'model__n_layers': 8,
    'pipeline__repeats': 2,
    'pipeline__schedule': '1f1b',
    'train__shard_optimizer': True,
  },
}


@pytest.mark.slow
@pytest.mark.parametrize('name', list(VARIANTS))
def test_schedules_remat_zero_and_loss_chunks_equal_one_device(name):
  # the bf16 wire rounds each rank's gradient to 8 bits of mantissa before the sum
  check(VARIANTS[name], **({'rtol': 2e-2, 'atol': 1e-5, 'loss_rtol': 1e-4} if 'bf16' in name else {}))


@pytest.mark.slow  # 40-90 s; the default suite keeps LoRA on 2-2-2 and documents at every layout
def test_documents_with_weights_equal_one_device():
  """Rows of documents (segment mask, positions, loss weights) with ZeRO-3 on 2-2-2."""
  check({**D222, 'train__shard_params': True}, documents=True)


def test_adapters_are_sharded_like_their_projection():
  """Stacked over pp like the layer; column-parallel (q, k, v, gate, up): A replicated, B split
  over tp like the output; row-parallel (o, down): A split over tp like the input, B replicated."""
  s = setup_for(small_cfg(**LORA, **D222))
  specs = {
    k: {x: tuple(v[x].spec) for x in 'ab'} for k, v in s.param_shardings['layers'].items() if 'lora' in k
  }
  assert specs == {
    'lora_q': {'a': ('pp', None, None), 'b': ('pp', None, 'tp', None, None)},
    'lora_k': {'a': ('pp', None, None), 'b': ('pp', None, 'tp', None)},
    'lora_v': {'a': ('pp', None, None), 'b': ('pp', None, 'tp', None)},
    'lora_o': {'a': ('pp', 'tp', None, None), 'b': ('pp', None, None)},
    'lora_gate': {'a': ('pp', None, None), 'b': ('pp', None, 'tp')},
    'lora_up': {'a': ('pp', None, None), 'b': ('pp', None, 'tp')},
    'lora_down': {'a': ('pp', 'tp', None), 'b': ('pp', None, None)},
  }
  # the optimizer holds the adapters' moments only
  mu = optax.tree.get(s.abstract_state['opt_state'], 'mu')
  assert all(lora.is_adapter(p) for p, _ in jax.tree_util.tree_flatten_with_path(mu)[0])


def test_config_errors_name_the_setting():
  for over, key in [
    ({'lora__targets': 'q,x'}, 'lora.targets'),
    ({'lora__dropout': 1.0}, 'lora.dropout'),
    ({'lora__rank': 4, 'lora__base_dtype': 'int8', 'pipeline__schedule': '1f1b'}, 'lora.base_dtype'),
    ({'lora__rank': -1}, 'lora.rank'),
    ({'lora__rank': 0, 'lora__base_dtype': 'bfloat16'}, 'lora.rank'),
  ]:
    with pytest.raises(ConfigError, match=key.replace('.', r'\.')):
      assemble.build(small_cfg(**over), jax.devices()[:1])


def _local_bytes(tree):
  return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize for a in jax.tree.leaves(tree))


@pytest.mark.parametrize('over', [{}, {'lora__base_dtype': 'bfloat16', 'train__shard_optimizer': True}])
def test_planner_prices_lora_state_as_built(over):
  """The memory model's LoRA parameters (base in its dtype plus adapters) and Adam moments (the
  adapters' only) equal the built state's bytes per device, on 2-2-2."""
  from jax3d.planning import memory_model

  s = setup_for(small_cfg(**{**LORA, **D222, **over}))
  b = memory_model.breakdown(s.cfg, s.plan, flash=False)
  assert b['params'] == pytest.approx(_local_bytes(s.abstract_state['params']), rel=1e-6)
  mu_nu = [optax.tree.get(s.abstract_state['opt_state'], k) for k in ('mu', 'nu')]
  assert b['optimizer'] == pytest.approx(_local_bytes(mu_nu), rel=1e-6)
  full = memory_model.breakdown(small_cfg(**D222, model__n_layers=4), s.plan, flash=False)
  assert b['optimizer'] < full['optimizer'] / 5 and b['grads'] < full['grads'] / 5


def test_oom_ladder_offers_lora_where_a_full_fine_tune_does_not_fit():
  from jax3d import config
  from jax3d.planning import costmodel, oom

  over = {'mesh.dp': 1, 'mesh.pp': 1, 'mesh.tp': 8, 'train.remat': 'full', 'train.global_batch_size': 8}
  cfg = config.load_config('llama3_8b', over | {'train.seq_len': 1024})
  node = costmodel.Hardware(nodes=1, gpus_per_node=8, memory_gb=16)
  lines = oom.oom_ladder(cfg, config.validate(cfg, 8), 16e9, node)
  rung = next(x for x in lines if x.startswith('7. LoRA'))
  assert '--config.lora.rank=16' in rung and 'FITS' in rung, rung


def test_time_model_prices_lora_without_base_weight_gradients():
  """LoRA's compute is the forward and input gradients of the base (4 FLOPs per weight and token,
  not 6) plus the adapters'; its dp all-reduce carries the adapters' gradients only."""
  from jax3d import config
  from jax3d.planning import costmodel, memory_model, time_model

  over = {'mesh.dp': 8, 'mesh.pp': 1, 'mesh.tp': 1, 'pipeline.microbatches': 1, 'train.global_batch_size': 8}
  over |= {'train.seq_len': 256, 'train.remat': 'none'}  # the attention core small beside the matmuls
  full = config.load_config('llama3_8b', over)
  lo = config.load_config('llama3_8b', over | {'lora.rank': 16})
  plan, node = config.validate(full, 8), costmodel.Hardware(nodes=1, gpus_per_node=8, memory_gb=80)
  ratio = time_model.compute_seconds(lo, plan, node) / time_model.compute_seconds(full, plan, node)
  assert 4 / 6 < ratio < 0.7
  dp_bytes = time_model.dp_traffic(lo, plan)[0]
  assert dp_bytes == pytest.approx(2 * 7 / 8 * memory_model.lora_local_params(lo, plan) * 4)
  assert dp_bytes < time_model.dp_traffic(full, plan)[0] / 100


@pytest.mark.slow  # default-suite budget (CI runs -m slow too)
def test_bf16_base_is_stored_bf16_frozen_and_trains_like_float32():
  """lora.base_dtype=bfloat16: the base's weights are bf16 (the adapters and their moments stay
  float32), unchanged by training, and the losses those of the float32 base within bf16 rounding."""
  s = setup_for(small_cfg(**LORA, lora__base_dtype='bfloat16'))
  adapters, base = lora.split(s.abstract_state['params'], True)
  assert {str(a.dtype) for a in jax.tree.leaves(base)} == {'bfloat16'}
  assert {str(a.dtype) for a in jax.tree.leaves(adapters)} == {'float32'}
  s32 = setup_for(small_cfg(**LORA))
  start = jax.device_get(with_nonzero_b(s32, step_lib.make_init(s32)(0)['params']))  # the reference's
  losses, _, base0, base1 = run_lora(small_cfg(**LORA, lora__base_dtype='bfloat16'), start=start)
  chex.assert_trees_all_equal(base1, base0)
  np.testing.assert_allclose(losses, reference()[0], rtol=2e-3)
  assert losses[2] < losses[0]


@pytest.mark.slow
def test_a_seed_base_run_exports_merged_samples_and_refuses_an_adapter(tmp_path):
  """A LoRA run on a base from train.seed: its checkpoint holds the adapters only, yet sampling
  and `export --merge` read it whole (the base rebuilt from the seed); a PEFT adapter export is
  refused with one line (exit 2): it would have no base to load onto."""
  import os
  import subprocess
  import sys

  import hf_helpers
  import transformers

  from jax3d.hf import outdir
  from jax3d.trainer import workdir

  cfg = small_cfg(**LORA, train__steps=2, eval__every=0, log__every=1, train__global_batch_size=4)
  toks = np.random.default_rng(0).integers(0, 256, (4, 16))
  ours = hf_helpers.trained_logits(cfg, str(tmp_path / 'run'), toks, jax.devices()[:1])
  one = {'mesh.dp': 1, 'mesh.pp': 1, 'mesh.tp': 1}
  assert workdir.sample_workdir(
    str(tmp_path / 'run'), 'def ', 4, 0.0, overrides=one, devices=jax.devices()[:1]
  )
  workdir.export_workdir(str(tmp_path / 'run'), str(tmp_path / 'merged'), one, jax.devices()[:1], merge=True)
  # the merged export (the base rebuilt from the seed, the adapters merged) is the trained model
  merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / 'merged')).eval()
  assert hf_helpers.rel_err(hf_helpers.hf_logits(merged, toks), ours) < 1e-4
  r = subprocess.run(
    [
      sys.executable,
      '-m',
      'jax3d.export',
      f'--workdir={tmp_path / "run"}',
      f'--out={tmp_path / "a"}',
      '--config.mesh.dp=-1',
    ],
    capture_output=True,
    text=True,
  )
  assert r.returncode == 2 and r.stderr.strip().startswith('error:') and '--merge' in r.stderr, r.stderr
  assert len(r.stderr.strip().splitlines()) == 1
  assert not os.path.exists(tmp_path / 'a') and os.path.isfile(tmp_path / 'merged' / outdir.MARKER)


@pytest.mark.slow  # 12-40 s (default-suite budget; CI runs -m slow)
def test_inspection_counts_the_adapters_gradients_on_the_dp_wire():
  """The compiled step's dp collectives carry the adapters' gradients only, as jax3d.inspect's
  formula says (2-2-2, and ZeRO-1's explicit reduce-scatter + all-gather)."""
  for over in ({}, {'train__shard_optimizer': True}):
    r = assemble.inspect(small_cfg(**{**LORA, **D222, **over}), jax.devices())
    dp = [c for c in r['checks'] if c['axis'] == 'dp']
    assert all(c['ratio'] == pytest.approx(1.0, rel=0.02) for c in dp), dp
