"""The mixture-of-experts block (jax3d/model/moe.py) against a plain loop written here (every token
through its k experts, the capacity's drops by their rank), gradients too; the router statistics
and losses in the train step; layouts equal one device."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax3d import assemble, step as step_lib
from jax3d.model import llama, moe
from jax3d.model.dims import Dims

from helpers import canonical, fixed_batches, run_steps, setup_for, small_cfg

E, K, D, F = 4, 2, 16, 8


def dims(cf: float = 4.0, norm: bool = True) -> Dims:
  return Dims(
    2, D, 2, 2, 32, 256, 256, n_experts=E, top_k=K, norm_topk_prob=norm, d_expert=F, capacity_factor=cf
  )


def reference(params, x_btd, cap, norm):
  """The plain loop: softmax, top-k, renormalise; a token's j-th choice of expert e is dropped when
  at least `cap` assignments to e rank before it (choices before tokens: every first choice first)."""
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  x = np.asarray(x_btd, np.float64)
  b, t, d = x.shape
  y = np.zeros_like(x)
  stats = np.zeros((b, E + 3))
  for i in range(b):
    logits = x[i] @ p['router']
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind='stable')[:, :K]
    taken = np.zeros(E, int)
    counts = np.zeros(E)
    dropped = 0
    for j in range(K):
      for tok in range(t):
        e = top[tok, j]
        counts[e] += 1
        w = probs[tok, e] / (probs[tok, top[tok]].sum() if norm else 1.0)
        if taken[e] >= cap:
          dropped += 1
          continue
        taken[e] += 1
        gu = np.einsum('d,dgf->gf', x[i, tok], p['experts_gate_up'][e])
        h = gu[0] / (1 + np.exp(-gu[0])) * gu[1]
        y[i, tok] += w * (h @ p['experts_down'][e])
    lse = np.log(np.exp(logits).sum(-1))
    aux = E * np.sum(counts / t * probs.mean(0))
    stats[i] = np.concatenate([counts / (t * K), [dropped / (t * K), aux, np.mean(lse**2)]])
  return y, stats


def init(dm, b=3, t=10, seed=0):
  x = jax.random.normal(jax.random.key(seed), (b, t, D), jnp.float32)
  params = nn.unbox(moe.MoeMlp(dm).init(jax.random.key(1), x)['params'])
  params = {k: v * (20.0 if k == 'router' else 1.0) for k, v in params.items()}  # decisive routing
  return params, x


@pytest.mark.parametrize('cf,norm', [(4.0, True), (0.5, True), (4.0, False)])
def test_block_equals_plain_loop(cf, norm):
  dm = dims(cf, norm)
  params, x = init(dm)
  y, stats = moe.MoeMlp(dm).apply({'params': params}, x)
  stats = stats[:, 0]  # one share per row without cp
  cap = moe.capacity(dm, x.shape[1])
  assert cap == (10 if cf == 4.0 else math.ceil(0.5 * 10 * K / E))
  y_ref, stats_ref = reference(params, x, cap, norm)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(stats, stats_ref, rtol=1e-5, atol=1e-6)
  assert (stats[:, E] > 0).any() == (cf < 1)  # the small capacity drops, the large one does not


def test_block_gradients_equal_plain_loop():
  """Gradients of a weighted sum of the outputs and of the load-balancing and z losses, against
  the loop's by central differences in float64 (the loop is the definition; jax's through it)."""
  dm = dims(0.75)
  params, x = init(dm, b=2, t=6)
  cap = moe.capacity(dm, 6)
  c = np.asarray(jax.random.normal(jax.random.key(7), x.shape))

  def loss(p, x):
    y, stats = moe.MoeMlp(dm).apply({'params': p}, x)
    return jnp.sum(y * c) + jnp.sum(stats[:, 0, E + 1]) + 0.1 * jnp.sum(stats[:, 0, E + 2])

  def loss_ref(p, x):
    y, stats = reference(p, x, cap, True)
    return np.sum(y * c) + np.sum(stats[:, E + 1]) + 0.1 * np.sum(stats[:, E + 2])

  g_p, g_x = jax.grad(loss, argnums=(0, 1))(params, x)
  rng = np.random.default_rng(0)
  for name in ('router', 'experts_gate_up', 'experts_down'):
    for _ in range(3):
      idx = tuple(rng.integers(0, s) for s in params[name].shape)
      eps = 1e-4
      hi = {k: np.asarray(v, np.float64).copy() for k, v in params.items()}
      lo = {k: v.copy() for k, v in hi.items()}
      hi[name][idx] += eps
      lo[name][idx] -= eps
      num = (loss_ref(hi, x) - loss_ref(lo, x)) / (2 * eps)
      np.testing.assert_allclose(g_p[name][idx], num, rtol=2e-3, atol=2e-4)
  idx = (1, 3, 5)
  hi, lo = np.asarray(x, np.float64).copy(), np.asarray(x, np.float64).copy()
  hi[idx] += 1e-4
  lo[idx] -= 1e-4
  np.testing.assert_allclose(
    g_x[idx], (loss_ref(params, hi) - loss_ref(params, lo)) / 2e-4, rtol=2e-3, atol=2e-4
  )


EXPERTS = 8
MOE = {
  'moe__num_experts': EXPERTS,
  'moe__top_k': 2,
  'moe__d_expert': 32,
  'moe__capacity_factor': 4.0,  # E / k: every assignment has a slot
  'moe__z_loss_coef': 1e-3,
  'model__n_layers': 4,
}


@functools.cache
def one_device():
  return run_steps(small_cfg(**MOE))


def check(over, rtol=1e-5):
  losses, grads, _ = run_steps(small_cfg(**MOE, **over))
  r_losses, r_grads, _ = one_device()
  np.testing.assert_allclose(losses, r_losses, rtol=rtol)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-7), grads, r_grads)
  assert losses[2] < losses[0]


SLOW = pytest.mark.slow
EP_LAYOUTS = [
  pytest.param({'mesh__ep': 8}, id='ep8'),
  pytest.param({'mesh__ep': 2, 'mesh__tp': 2, 'mesh__dp': 2}, id='ep2-tp2-dp2'),
  pytest.param({'mesh__ep': 4, 'mesh__pp': 2, 'pipeline__microbatches': 2}, id='ep4-pp2'),
  pytest.param(
    {'mesh__dp': 2, 'mesh__pp': 2, 'mesh__tp': 2, 'pipeline__microbatches': 2}, id='dp2-pp2-tp2', marks=SLOW
  ),
  pytest.param(
    {'mesh__ep': 2, 'mesh__pp': 2, 'mesh__tp': 2, 'pipeline__microbatches': 2, 'pipeline__schedule': '1f1b'},
    id='ep2-pp2-tp2-1f1b',
    marks=SLOW,
  ),
  pytest.param(
    {'mesh__ep': 2, 'mesh__pp': 2, 'pipeline__microbatches': 4, 'pipeline__repeats': 2, 'mesh__dp': 2},
    id='ep2-pp2-dp2-circular',
    marks=SLOW,
  ),
  pytest.param({'mesh__ep': 4, 'mesh__dp': 2, 'train__shard_optimizer': True}, id='ep4-zero1', marks=SLOW),
  pytest.param({'mesh__ep': 2, 'mesh__dp': 4, 'train__shard_params': True}, id='ep2-zero3', marks=SLOW),
  pytest.param(
    {'mesh__ep': 4, 'mesh__dp': 2, 'train__grad_accum': 2, 'train__remat': 'full'},
    id='ep4-accum-remat',
    marks=SLOW,
  ),
]


CP_LAYOUTS = [
  pytest.param({'mesh__cp': 2, 'mesh__ep': 2, 'mesh__tp': 2}, id='cp2-ep2-tp2'),
  pytest.param({'mesh__cp': 2, 'mesh__tp': 2, 'mesh__dp': 2}, id='cp2-tp2-dp2', marks=SLOW),
  pytest.param(
    {'mesh__cp': 2, 'mesh__pp': 2, 'mesh__tp': 2, 'pipeline__microbatches': 2}, id='cp2-pp2-tp2', marks=SLOW
  ),
  pytest.param(
    {'mesh__cp': 2, 'mesh__ep': 2, 'mesh__pp': 2, 'pipeline__microbatches': 2, 'pipeline__schedule': '1f1b'},
    id='cp2-ep2-pp2-1f1b',
    marks=SLOW,
  ),
  pytest.param(
    {'mesh__cp': 4, 'mesh__ep': 2, 'train__shard_optimizer': True}, id='cp4-ep2-zero1', marks=SLOW
  ),
  pytest.param({'mesh__cp': 2, 'mesh__dp': 4, 'train__remat': 'full'}, id='cp2-dp4-remat', marks=SLOW),
]


@pytest.mark.parametrize('over', EP_LAYOUTS + CP_LAYOUTS)
def test_moe_layouts_equal_one_device(over):
  """Losses of 3 steps and the step-1 gradients of every layout with ep (and with cp: a capacity
  group per cp rank's share of a row) equal one device's within 1e-5 (the capacity drops nothing)."""
  check(over)


@pytest.mark.parametrize(
  'over',
  [
    pytest.param({'mesh__ep': 4, 'mesh__dp': 2}, id='ep4-dp2'),
    pytest.param(
      {'mesh__ep': 2, 'mesh__pp': 2, 'mesh__tp': 2, 'pipeline__microbatches': 2}, id='ep2-pp2', marks=SLOW
    ),
    pytest.param({'mesh__ep': 4, 'mesh__dp': 2, 'train__remat': 'full'}, id='ep4-remat-full', marks=SLOW),
    pytest.param({'mesh__ep': 2, 'mesh__cp': 2, 'mesh__dp': 2}, id='ep2-cp2-dp2', marks=SLOW),
  ],
)
def test_expert_parallel_dispatch_is_the_formulas_all_to_alls(over):
  """With ep the compiled step moves the experts' slots by all-to-all over ep (not by gathering
  the experts' weights), exactly the bytes of docs/formulas.md (jax3d/analysis/ep_comm.py: 5 per
  layer and micro-batch, every pipeline iteration), and each device holds 1/ep of the experts."""
  cfg = small_cfg(**MOE, **over)
  s = setup_for(cfg)
  r = assemble.compile_train_step(s).analysis()
  (check,) = [c for c in r['checks'] if c['axis'] == 'ep']
  assert check['measured'] > 0
  np.testing.assert_allclose(check['measured'], check['spmd'], rtol=1e-6)
  weights = {EXPERTS * 64 * 2 * 32 * 4, EXPERTS * 32 * 64 * 4}  # one layer's experts, whole (fp32)
  gathered = [
    c for c in r['collectives'] if c['kind'] == 'all-gather' and c['buffer_bytes'] / c['count'] in weights
  ]
  assert not gathered  # the experts stay on their ep ranks: their tokens travel, not their weights
  gu = s.param_shardings['layers']['moe']['experts_gate_up']
  assert gu.shard_shape((cfg.model.n_layers, EXPERTS, 64, 2, 32))[1] == EXPERTS // cfg.mesh.ep


def test_dp_reduction_keeps_the_experts_on_their_ep_ranks():
  """Under ZeRO-1 (the dp sum done by hand, jax3d/parallel/data_parallel.py) with ep, each device
  reduce-scatters over dp the gradients of its own experts only, never every expert's whole (what
  the reduction nested over tp alone did: Mixtral 8x7B at dp 2 x ep 8 compiled to 223 GB on H100s)."""
  cfg = small_cfg(**MOE, mesh__ep=4, mesh__dp=2, train__shard_optimizer=True)
  r = assemble.compile_train_step(setup_for(cfg)).analysis()
  whole = {4 * EXPERTS * 64 * 2 * 32 * 4, 4 * EXPERTS * 32 * 64 * 4}  # 4 layers' experts (fp32)
  scattered = {c['buffer_bytes'] for c in r['collectives'] if c['kind'] == 'reduce-scatter'}
  assert scattered and not scattered & whole


def step_metrics(over):
  cfg = small_cfg(**{**MOE, **over})
  s = setup_for(cfg)
  state = step_lib.make_init(s)(cfg.train.seed)
  batch = {k: jax.device_put(v, s.batch_sharding) for k, v in fixed_batches(cfg, 1)[0].items()}
  params = canonical(s, state['params'])
  return s, params, batch, assemble.compile_train_step(s)(state, batch)[1]


def test_router_metrics_are_the_layers_statistics():
  """The step's moe_* metrics (read from the probe's gradient) equal the layers' statistics
  computed here layer by layer (mean over sequences and layers), on one device and on (2,2,2)
  with two micro-batches and two accumulation chunks; the loss holds the router losses."""
  s, params, batch, m = step_metrics({'moe__capacity_factor': 0.5})
  x = llama.embed_apply(s.dims, params, batch['inputs'])
  x = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)
  for i in range(s.dims.n_layers):
    layer = jax.tree.map(lambda a, i=i: a[i], params['layers'])
    x = llama.block_apply(s.dims, layer, x, stats_row=True)
  b = batch['inputs'].shape[0]
  mean = np.asarray(x[:, -1, : EXPERTS + 3]).sum(0) / (b * s.dims.n_layers)
  np.testing.assert_allclose(m['moe_load'], mean[:EXPERTS], rtol=1e-5)
  np.testing.assert_allclose(np.sum(m['moe_load']), 1.0, rtol=1e-6)
  assert float(m['moe_dropped']) > 0.05  # capacity 0.5 drops
  for key, i in (('moe_dropped', EXPERTS), ('moe_aux_loss', EXPERTS + 1), ('moe_z_loss', EXPERTS + 2)):
    np.testing.assert_allclose(m[key], mean[i], rtol=1e-5)
  y = llama.head_apply(s.dims, params, x[:, :-1])
  ce = float(np.mean(llama.token_cross_entropy(y, batch['targets'])))
  np.testing.assert_allclose(m['loss'], ce + 0.01 * mean[EXPERTS + 1] + 1e-3 * mean[EXPERTS + 2], rtol=1e-5)
  over = {'mesh__dp': 2, 'mesh__pp': 2, 'mesh__tp': 2, 'pipeline__microbatches': 2, 'train__grad_accum': 2}
  m2 = step_metrics({'moe__capacity_factor': 0.5, **over})[3]
  for key in ('moe_load', 'moe_dropped', 'moe_aux_loss', 'moe_z_loss', 'loss'):
    np.testing.assert_allclose(m2[key], m[key], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
  'over',
  [
    {'mesh__cp': 2, 'mesh__ep': 2, 'mesh__tp': 2},
    {'mesh__cp': 4, 'mesh__pp': 2, 'pipeline__microbatches': 2},
  ],
)
def test_router_metrics_with_cp_equal_one_device(over):
  """With cp the step's moe_* metrics (each cp rank's share of a row's statistics, summed) equal one
  device's when nothing is dropped; with a capacity that drops, the loads still sum to 1 and the
  dropped share is counted (per cp rank's share: docs/models.md)."""
  m = step_metrics({})[3]
  m_cp = step_metrics(over)[3]
  for key in ('moe_load', 'moe_dropped', 'moe_aux_loss', 'moe_z_loss', 'loss'):
    np.testing.assert_allclose(m_cp[key], m[key], rtol=1e-5, atol=1e-7)
  assert float(m['moe_dropped']) == 0.0
  m_drop = step_metrics({'moe__capacity_factor': 0.5, **over})[3]
  np.testing.assert_allclose(np.sum(m_drop['moe_load']), 1.0, rtol=1e-6)
  assert float(m_drop['moe_dropped']) > 0.05


def _trainer_cfg(**over):
  ov = {k.replace('__', '.'): v for k, v in {**MOE, **over}.items()}
  ov |= {'train.steps': 4, 'log.every': 1, 'eval.every': 0, 'eval.batches': 1, 'checkpoint.every': 3}
  ov |= {'log.progress': False, 'train.seq_len': 16, 'train.global_batch_size': 16}
  return small_cfg(**{k.replace('.', '__'): v for k, v in ov.items()})


def test_checkpoint_resumes_onto_another_ep(tmp_path):
  """Trained 3 steps on ep=2 x dp=2 x tp=2, resumed on ep=4 x dp=2: the same state (canonical),
  and the 4th step's loss and router metrics equal the uninterrupted run's; metrics.jsonl holds
  them (per-expert load and the dropped share)."""
  import json
  import os
  import shutil

  from jax3d.trainer import checkpoint as ckpt_lib
  from jax3d.trainer.trainer import Trainer

  def state(t):
    perm = np.argsort(np.arange(t.cfg.model.n_layers))
    return jax.device_get(ckpt_lib.permute_layers(t.state, perm, jax.tree.map(lambda a: a.sharding, t.state)))

  def records(path):
    return {r['step']: r for r in map(json.loads, open(os.path.join(path, 'metrics.jsonl'))) if 'loss' in r}

  src = Trainer(_trainer_cfg(mesh__ep=2, mesh__dp=2, mesh__tp=2), workdir=str(tmp_path), console=False)
  src.train(steps=3)
  saved = state(src)
  src.train(steps=1)
  ref = records(str(tmp_path))[4]
  src.close()
  assert len(ref['moe_load']) == EXPERTS and abs(sum(ref['moe_load']) - 1) < 1e-5
  assert ref['moe_dropped'] == 0.0 and ref['moe_aux_loss'] > 0
  os.remove(tmp_path / 'metrics.jsonl')
  shutil.rmtree(tmp_path / 'checkpoints' / '4')
  dst = Trainer(_trainer_cfg(mesh__ep=4, mesh__dp=2), workdir=str(tmp_path), console=False)
  assert 'resumed' in dst.init_state()
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), state(dst), saved)
  dst.train(steps=1)
  got = records(str(tmp_path))[4]
  dst.close()
  for key in ('loss', 'moe_aux_loss', 'moe_z_loss'):
    np.testing.assert_allclose(got[key], ref[key], rtol=1e-5)
  np.testing.assert_allclose(got['moe_load'], ref['moe_load'], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_lora_on_attention_with_ep_equals_one_device():
  lora = {'lora__rank': 4, 'lora__targets': 'q,k,v,o'}
  losses, grads, _ = run_steps(small_cfg(**MOE, **lora, mesh__ep=4, mesh__dp=2))
  r_losses, r_grads, _ = run_steps(small_cfg(**MOE, **lora))
  np.testing.assert_allclose(losses, r_losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, r_grads)
  assert losses[2] < losses[0]


@pytest.mark.parametrize(
  'over', [{'mesh__ep': 4, 'mesh__dp': 2}, {'mesh__ep': 2, 'mesh__tp': 2, 'mesh__dp': 2}]
)
def test_planner_counts_the_layers_parameters_a_device_holds(over):
  """The memory model's layer parameters per device (the experts over tp and ep, the router whole)
  equal what the shardings give each device; the formula's total equals the leaves' count."""
  from jax3d.planning import memory_model

  cfg = small_cfg(**MOE, **over)
  s = setup_for(cfg)
  layers = s.abstract_state['params']['layers']
  held = sum(
    int(np.prod(sh.shard_shape(a.shape)))
    for a, sh in zip(jax.tree.leaves(layers), jax.tree.leaves(s.param_shardings['layers']), strict=True)
  )
  assert memory_model.local_params(s.cfg, s.plan)['layers'] == held
  total = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(s.abstract_state['params']))
  probe = EXPERTS + 3  # the router statistics' probe: no weight
  padded = (s.dims.vocab_padded - s.dims.vocab_size) * s.dims.d_model * 2
  assert s.dims.param_count() == total - probe - padded


@pytest.mark.parametrize(
  'name,devices,total,active',
  [('qwen3_30b_a3b', 8, 30.53e9, 3.35e9), ('mixtral_8x7b', 16, 46.70e9, 12.88e9)],
)
def test_gpu_target_configs_are_the_published_models(name, devices, total, active):
  """configs/qwen3_30b_a3b.py (h100x8) and configs/mixtral_8x7b.py (h100x16) validate on their
  targets' device counts with ep, and count the published models' parameters (active: the top-k
  experts and the input embedding)."""
  from jax3d import config as config_lib
  from jax3d.model import formulas
  from jax3d.model.dims import Dims

  cfg = config_lib.load_config(f'configs/{name}.py')
  typed, plan = config_lib.validated(cfg, devices)
  assert plan.ep > 1 and plan.n_devices == devices
  dims = Dims.from_config(typed, plan)
  np.testing.assert_allclose(dims.param_count(), total, rtol=2e-3)
  np.testing.assert_allclose(formulas.model_params(dims) + dims.vocab_size * dims.d_model, active, rtol=5e-3)


def test_oom_ladder_offers_more_expert_parallelism():
  """Qwen3-30B-A3B as dp=8 on 80 GB GPUs: the ladder's ep rung moves the dp ranks into ep (16
  experts per GPU) and prices it by the experts' parameters it no longer holds."""
  import re

  from jax3d import config as config_lib
  from jax3d.planning.oom import oom_ladder

  cfg = config_lib.load_config('configs/qwen3_30b_a3b.py', {'mesh.dp': 8, 'mesh.ep': 1})
  lines = oom_ladder(cfg, config_lib.validate(cfg, 8), 80e9)
  (rung,) = [line for line in lines if line.startswith('4e.')]
  assert 'ep=8 (16 per device)' in rung and '--config.mesh.ep=8 --config.mesh.dp=1' in rung
  before, after = (float(x) for x in re.search(r'([\d.]+) GB -> ([\d.]+) GB', rung).groups())
  assert after < before / 3  # the experts are 95% of the parameters
