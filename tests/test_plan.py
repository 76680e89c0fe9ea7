"""The layout planner: estimator numbers by hand, the tutorial's rules, the CLI, and the estimate
against XLA's compiled memory figure on 8 fake CPU devices."""

import os
import sys

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import json
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jax3d import config
from jax3d.planning import costmodel, explain, planner as plan

CPU = costmodel.Hardware(flash_attention=False, gpu=False)  # priced as XLA:CPU compiles


def cli(*args, timeout=240):
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8', JAX_PLATFORMS='cpu')
  return subprocess.run(
    [sys.executable, '-m', 'jax3d.plan', *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


@pytest.fixture(scope='module')
def llama70b_8x8():
  cfg = config.load_config('llama3_70b')
  hw = costmodel.Hardware(nodes=8, gpus_per_node=8, memory_gb=80)
  # The tutorial's 3D rules, the state replicated or ZeRO-1 (ZeRO-3 lets dp=32 pp=1 tp=2 fit and win:
  # tests/test_zero3_plan.py).
  return cfg, hw, plan.search(cfg, hw, zero=('off', 'zero1'))


def test_estimate_by_hand_tiny():
  cfg = config.load_config('tiny', {'train.remat': 'stage'})  # dp=2 pp=2 tp=2, m=4, fp32
  p = config.validate(cfg, 8)
  e = costmodel.estimate(cfg, p, hw=CPU)
  # Layer matrices 256*64*(2*4 + 2*2) + 3*256*768 = 786432, over tp; norms 2*256; 4 layers / pp.
  # Embedding and head 2*256*256 over tp, plus the final norm 256.
  n_local = 2 * (786432 // 2 + 512) + 2 * 256 * 256 // 2 + 256
  assert n_local == 853248
  assert e.breakdown['params'] == 4 * n_local
  # Gradients: the step's, plus the pipeline loop's per-iteration gradient of the stage's layers.
  assert e.breakdown['grads'] == 4 * n_local + 4 * 2 * (786432 // 2 + 512)
  assert e.breakdown['optimizer'] == 8 * n_local  # AdamW m and v, fp32, not sharded
  assert 'update' not in e.breakdown  # the cond's update writes in place: no second copy
  # remat=stage: each of the v*m+p-1 = 5 iterations keeps its input and the 4-entry stage-0 queue,
  # micro-batch [2 rows, 128, 256] fp32; plus one iteration recomputed (2 checkpointed layers + 1 layer).
  carry = 5 * (4 + 1) * 2 * 128 * 256 * 4
  layer_full = costmodel.layer_residual_bytes(256, 4, 2, 768, 128, 2, 'full', 'float32', 'float32', False, 2)
  # The input [2, 128, 256] and rope's cos and sin [128, 32] (fp32); not the weights: they are
  # sliced again from the stack in the backward pass.
  assert layer_full == 2 * 128 * 256 * 4 + 2 * 128 * 32 * 4
  layer_none = costmodel.layer_residual_bytes(256, 4, 2, 768, 128, 2, 'none', 'float32', 'float32', False, 2)
  assert e.breakdown['activations'] == pytest.approx(carry + 2 * layer_full + layer_none)
  # remat=full: each iteration keeps the input of each of its 2 layers; one layer recomputed.
  full = costmodel.estimate(config.load_config('tiny', {'train.remat': 'full'}), p, hw=CPU)
  assert full.breakdown['activations'] == pytest.approx(5 * 2 * layer_full + layer_none)
  # Head: 4 rows (16 / (dp*pp)) x 128 x (3 fp32 copies of 128 vocab columns + the 256-wide input).
  assert e.breakdown['head'] == 4 * 128 * (3 * 4 * 128 + 2 * 256 * 4)
  # Model FLOPs per token 6P + 12*L*h*s, P = 3279104 parameters less the 256*256 input embedding.
  assert e.model_flops_per_token == 6 * (3279104 - 256 * 256) + 12 * 4 * 256 * 128
  assert p.bubble == pytest.approx(1 / 5)
  t = e.times
  assert t['step'] == pytest.approx(t['compute'] + t['tp'] + t['pp'] + t['dp'] - t['dp_hidden'])
  # The dp all-reduce: 2*(d-1)/d * local params * 4 bytes over NVLink (450 GB/s).
  assert t['dp'] == pytest.approx(4 * n_local / 450e9)


def test_zero1_and_bf16_shrink_the_state():
  base = config.load_config('tiny', {'mesh.pp': 1, 'mesh.dp': 4, 'pipeline.microbatches': 1})
  p = config.validate(base, 8)
  e0 = costmodel.estimate(base, p, hw=CPU)
  e1 = costmodel.estimate(plan.with_overrides(base, {'train.shard_optimizer': True}), p, hw=CPU)
  e2 = costmodel.estimate(plan.with_overrides(base, {'train.param_dtype': 'bfloat16'}), p, hw=CPU)
  assert e1.breakdown['optimizer'] == pytest.approx(e0.breakdown['optimizer'] / 4)
  assert e2.breakdown['params'] == pytest.approx(e0.breakdown['params'] / 2)


def test_rules_on_8x8(llama70b_8x8):
  cfg, hw, ranked = llama70b_8x8
  assert ranked and all(c.plan.tp <= 8 for c in ranked)
  assert all(c.plan.dp * c.plan.cp * c.plan.pp * c.plan.tp == 64 for c in ranked)
  assert all(cfg.model.n_layers % c.plan.pp == 0 for c in ranked)
  fits = [c for c in ranked if c.est.fits]
  assert fits and all(c.est.total_bytes <= 80e9 for c in fits)
  times = [c.est.step_time_s for c in fits]
  assert times == sorted(times)  # best first


def test_worked_example_explained_as_the_tutorial(llama70b_8x8):
  # 8 nodes x 8 GPUs, a 70B model: too wide for one GPU and too deep for one node.
  cfg, hw, ranked = llama70b_8x8
  best = next(c for c in ranked if c.est.fits)
  p = best.plan
  assert p.tp > 1 and p.pp > 1  # split in width and in depth
  text = '\n'.join(explain.explain(cfg, best, ranked, hw))
  i_tp, i_pp = text.index(f'tp = {p.tp}: at most the 8 GPUs per node'), text.index(f'pp = {p.pp}:')
  i_dp = text.index(f'dp = 64/(tp*pp) = 64/({p.tp}*{p.pp}) = {p.dp}')
  assert i_tp < i_pp < i_dp  # tp first, then pp, then dp = 64/(tp*pp)
  assert f'{cfg.model.n_layers} layers -> {cfg.model.n_layers // p.pp} per stage' in text


def test_json_and_emit():
  r = cli('--config=configs/tiny.py', '--nodes=1', '--gpus-per-node=8', '--json', '--top=3')
  assert r.returncode == 0, r.stderr
  rows = json.loads(r.stdout)
  assert len(rows) == 3 and [x['rank'] for x in rows] == [1, 2, 3]
  for x in rows:
    assert x['dp'] * x['pp'] * x['tp'] == 8 and x['fits'] is True and x['reason'] == ''
    assert x['memory_gb'] == pytest.approx(sum(x['memory_breakdown_gb'].values()), abs=0.01)
    assert x['step_time_s'] > 0 and 0 <= x['bubble'] < 1
  assert rows[0]['step_time_s'] <= rows[1]['step_time_s'] <= rows[2]['step_time_s']
  r = cli('--config=configs/tiny.py', '--emit')
  best = rows[0]
  assert r.returncode == 0 and r.stdout.startswith(
    f'--config.mesh.dp={best["dp"]} --config.mesh.pp={best["pp"]} --config.mesh.tp={best["tp"]}'
  )


@pytest.mark.slow  # default-suite budget (CI runs -m slow too)
def test_misfit_reason_and_oom_ladder():
  r = cli('--config=configs/llama3_70b.py', '--nodes=1', '--gpus-per-node=8', '--gpu-memory-gb=80')
  assert r.returncode == 2
  assert re.search(r'needs \d+\.\d GB per GPU, has 80', r.stdout)
  for rung in ('1. recomputation', '3. smaller micro-batch', '4. more pp or tp', '5. bf16'):
    assert rung in r.stdout
  m = re.search(
    r'Smallest cluster that fits: (\d+) node\(s\) x 8 GPUs of 80 GB \(dp=(\d+), pp=(\d+), '
    r'tp=(\d+), remat=\w+: ([\d.]+) GB per GPU\)',
    r.stdout,
  )
  assert m, r.stdout
  nodes, dp, pp, tp, gb = int(m[1]), int(m[2]), int(m[3]), int(m[4]), float(m[5])
  assert nodes > 1 and dp * pp * tp == nodes * 8 and tp <= 8 and gb <= 80
  assert r.stderr.startswith('error: no layout of llama3_70b fits 1 x 8 GPUs of 80 GB')


@pytest.mark.parametrize(
  'args',
  [
    ['--nodes=0'],
    ['--gpu-memory-gb=-1'],
    ['--config.model.nope=1'],
    ['--config=configs/none.py'],
    [
      '--nodes=8',
      '--config.model.n_layers=7',
      '--config.model.n_heads=7',
      '--config.model.n_kv_heads=7',
      '--config.model.d_model=14',
      '--config.train.seq_len=126',  # no 2*cp chunks: dp=8 cp=8 would be valid
    ],
  ],
)
def test_bad_input_exits_2(args):
  r = cli('--config=configs/tiny.py', *args)
  assert r.returncode == 2 and r.stderr.startswith('error: ') and len(r.stderr.strip().splitlines()) == 1


def _verified_ratio(*args):
  r = cli('--fixed', '--verify', *args)
  assert r.returncode == 0, r.stderr[-2000:]
  est = float(re.search(r'estimate: ([\d.]+) GB', r.stdout).group(1))
  xla = float(re.search(r'XLA \(compiled on 8 CPU devices\): ([\d.]+) GB', r.stdout).group(1))
  return est / xla


@pytest.mark.parametrize(
  'overrides',
  [
    [],
    ['--config.train.remat=full'],
    pytest.param(['--config.train.remat=stage'], marks=pytest.mark.slow),
    pytest.param(['--config.train.remat=dots'], marks=pytest.mark.slow),
    pytest.param(
      ['--config.train.sequence_parallel=true', '--config.train.remat=none'], marks=pytest.mark.slow
    ),
    ['--config.train.sequence_parallel=true', '--config.train.remat=full'],
  ],
)
def test_verify_tiny_within_25_percent(overrides):
  assert _verified_ratio('--config=configs/tiny.py', *overrides) == pytest.approx(1, abs=0.25)


def test_verify_gpt2_small_within_25_percent():
  ratio = _verified_ratio(
    '--config=configs/gpt2_small.py',
    '--config.mesh.dp=2',
    '--config.mesh.pp=2',
    '--config.mesh.tp=2',
    '--config.train.seq_len=256',
    '--config.train.global_batch_size=16',
    '--config.train.compute_dtype=float32',
  )  # the estimate models a GPU's bf16
  assert ratio == pytest.approx(1, abs=0.25)


def test_sequence_parallel_divides_the_residual_stream_by_tp():
  """Read off the real layer: under remat 'full' a layer keeps its input [b, s, d], which SP
  splits over tp; under 'none' the stream's part (what grows with d_model) is divided by tp."""
  args = (256, 4, 4, 1024, 128, 2)  # d_model, heads, kv heads, d_ff, seq, tp
  res = lambda policy, sp: costmodel.layer_residual_bytes(
    *args, policy, 'float32', 'float32', False, 2, sequence_parallel=sp
  )
  x = 2 * 128 * 256 * 4  # the layer's input; 'full' also keeps the rotary angles, which SP does not split
  assert res('full', False) >= x and res('full', False) - res('full', True) == x / 2
  assert res('none', True) < res('none', False)
  cfg = config.load_config('tiny', {'train.remat': 'none'})
  on = config.load_config('tiny', {'train.remat': 'none', 'train.sequence_parallel': 'true'})
  a, b = (costmodel.estimate(c, config.validate(c, 8)).breakdown['activations'] for c in (cfg, on))
  assert b < a


def test_oom_ladder_more_tp_rung_states_the_sequence_parallel_saving():
  from jax3d.planning import oom

  cfg = config.load_config('tiny', {'mesh.dp': 8, 'mesh.pp': 1, 'mesh.tp': 1, 'pipeline.microbatches': 1})
  p = config.validate(cfg, 8)
  line = oom._sequence_parallel(cfg, {'mesh.dp': 4, 'mesh.tp': 2}, p, 1e9, costmodel.Hardware())
  m = re.search(
    r'activations at tp=2: ([\d.e-]+) GB without sequence parallelism, ([\d.e-]+) GB with it', line
  )
  assert m and float(m[2]) < float(m[1]), line


# A mixture of experts whose experts are most of its memory: one layer (pp = 1), one KV head (tp = 1),
# 8 experts of 4096 (25M parameters a layer): only ep (or ZeRO) can split them.
WIDE_MOE = {'model.n_layers': 1, 'model.n_kv_heads': 1, 'moe.d_expert': 4096}


def test_planner_searches_ep_and_takes_it_where_only_ep_fits():
  """The planner enumerates mesh.ep for a mixture (the divisors of the experts, ep*tp inside a node,
  dp filling the rest) and never for a dense model; on GPUs that hold the mixture only with its
  experts split (the state replicated over dp), its best layout has ep > 1 and says why."""
  cfg = config.load_config('tiny_moe', WIDE_MOE | {'mesh.ep': 1, 'mesh.dp': -1, 'mesh.tp': 1})
  roomy = plan.search(cfg, costmodel.Hardware(memory_gb=1e3, gpu=False), zero=('off',))
  assert {c.plan.ep for c in roomy} == {1, 2, 4, 8}
  assert all(c.plan.dp * c.plan.ep == 8 and c.overrides['mesh.ep'] == c.plan.ep for c in roomy)
  least = {e: min(c.est.total_bytes for c in roomy if c.plan.ep == e) for e in (1, 2)}
  state = lambda c: sum(c.est.breakdown[k] for k in ('params', 'grads', 'optimizer'))
  held = {e: min(state(c) for c in roomy if c.plan.ep == e) for e in (1, 2)}
  assert held[2] < 0.6 * held[1] and least[2] < least[1]  # the experts' state halves
  hw = costmodel.Hardware(memory_gb=(least[1] + least[2]) / 2e9, gpu=False)
  ranked = plan.search(cfg, hw, zero=('off',))
  best = ranked[0]
  assert best.est.fits and best.plan.ep > 1
  assert not any(c.est.fits for c in ranked if c.plan.ep == 1)
  text = '\n'.join(explain.explain(config.typed(cfg), best, ranked, hw))
  assert f'ep = {best.plan.ep}: the 8 experts of each layer split over {best.plan.ep} GPUs' in text
  assert 'the best without it needs' in text
  dense = config.load_config('tiny')
  assert {ep for _, _, ep in plan._inner(costmodel.Hardware(), dense)} == {1}
  assert all(c.plan.ep == 1 for c in plan.search(dense, costmodel.Hardware(memory_gb=1e3, gpu=False)))


def test_time_model_prices_the_experts_all_to_all_by_the_formula():
  """The time model's ep term, by hand (docs/formulas.md): per layer and micro-batch 5 all-to-alls
  of the slots [b, E, C, d], each (e-1)/e of them, times the loop's iterations and the accumulation
  steps, plus the all-reduce over ep of the gradients of what ep replicates (all but the experts),
  2(e-1)/e of them; over NVLink (ep*tp inside a node)."""
  over = {'mesh.dp': 1, 'mesh.ep': 4, 'mesh.tp': 2, 'mesh.pp': 1, 'train.grad_accum': 2}
  cfg = config.load_config('tiny_moe', over)
  p = config.validate(cfg, 8)
  e = costmodel.estimate(cfg, p, hw=CPU)
  b, experts, d = 16 // 2 // 4, 8, 256  # rows per device: the chunk's 8 over dp*ep
  slots = -(-1.25 * 128 * 2 // experts)  # C = ceil(cf*t*k/E) = 40
  a2a = 5 * 3 / 4 * b * experts * slots * d * 4 * 4 * 2  # 4 layers, 2 accumulation steps, fp32
  # Replicated over ep, per tp shard: q, k, v, o (256 x 64 x (2*4 + 2*2) / 2), 2 norms, the router;
  # the embedding and head (2 x 256 x 256 / 2) and the final norm.
  replicated = 4 * (256 * 64 * 12 // 2 + 2 * 256 + 256 * 8) + 2 * p.vocab_padded * 256 // 2 + 256
  assert e.times['ep'] == pytest.approx((a2a + 2 * 3 / 4 * replicated * 4) / 450e9)
  t = e.times
  assert t['step'] == pytest.approx(t['compute'] + t['tp'] + t['pp'] + t['ep'] + t['dp'] - t['dp_hidden'])
  dense_ep = plan.with_overrides(cfg, {'mesh.ep': 1, 'mesh.dp': 4})
  assert costmodel.estimate(dense_ep, config.validate(dense_ep, 8), hw=CPU).times['ep'] == 0


def test_moe_activations_are_what_the_moe_layer_keeps():
  """A mixture's layer is priced as the MoE block keeps it (read off jax3d/model/moe.py), its rows
  split over dp*ep. Under remat 'dots', by hand for tiny_moe at dp 2, ep 2, tp 2: the rotary angles
  (cos, sin [128, 32]), and per row of 128 tokens the input and attention's output projection
  [128, 256], this shard's QKV [128, 1 KV head, 4, 64] and the router's logits [128, 8] (fp32);
  not the experts' matmuls (batched over the experts, which 'dots' does not save), and not a dense
  MLP of model.d_ff (its gate/up [128, 2, 384] would be kept)."""
  over = {'mesh.dp': 2, 'mesh.ep': 2, 'mesh.tp': 2, 'mesh.pp': 1, 'train.remat': 'dots'}
  cfg = config.load_config('tiny_moe', over)
  p = config.validate(cfg, 8)
  rows = 16 // (2 * 2)  # the micro-batch's 16 sequences over dp*ep
  hand = 2 * 128 * 32 * 4 + rows * 128 * (256 + 4 * 64 + 256 + 8) * 4
  moe = (8, 2, 256, 0, 1.25)  # experts, top_k, d_expert, d_shared, capacity_factor
  res = lambda policy: costmodel.layer_residual_bytes(
    256, 4, 2, 768, 128, 2, policy, 'float32', 'float32', False, rows, moe=moe
  )
  assert res('dots') == hand
  # 4 layers in the loop's one iteration, and one layer's intermediates while it is recomputed
  e = costmodel.estimate(cfg, p, hw=CPU)
  assert e.breakdown['activations'] == pytest.approx(4 * hand + res('none'))
