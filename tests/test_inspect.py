"""jax3d.inspect: the HLO reader on known inputs, then the tiny model's (2,2,2) step against
the expected bytes of `expected_comm` (jax3d/analysis/comm_checks.py). Bytes are per device per
optimizer step (see jax3d/inspect.py)."""

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from jax3d import assemble, config
from jax3d.analysis import hlo, inspection

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = (2, 2, 2)  # (dp, pp, tp); device id = 4*dp + 2*pp + tp
TP = 'tp'


# --- the HLO reader ---------------------------------------------------------------------------
@pytest.mark.parametrize(
  'attrs, groups, axes',
  [
    ('replica_groups={{0,1},{4,5},{2,3},{6,7}}, to_apply=%add', [[0, 1], [4, 5], [2, 3], [6, 7]], 'tp'),
    ('replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add', [[0, 4], [1, 5], [2, 6], [3, 7]], 'dp'),
    ('replica_groups=[4,2]<=[2,2,2]T(0,2,1), dimensions={0}', [[0, 2], [1, 3], [4, 6], [5, 7]], 'pp'),
    (
      "replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_0'}, x=1",
      [[0, 2], [1, 3], [4, 6], [5, 7]],
      'pp',
    ),
    (
      "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_2'}, use_global_device_ids=true",
      [[0, 1], [2, 3], [4, 5], [6, 7]],
      'tp',
    ),
    ("replica_groups=mesh['a'=2,'b'=4] {'b'}, x", [[0, 1, 2, 3], [4, 5, 6, 7]], 'pp+tp'),
    ('source_target_pairs={{0,2},{2,0},{1,3},{3,1}}, x', [[0, 2], [2, 0], [1, 3], [3, 1]], 'pp'),
  ],
)
def test_replica_groups(attrs, groups, axes):
  got = hlo.replica_groups(attrs, 8)
  assert got == groups
  assert hlo.group_axes(got, MESH) == axes


def test_shape_bytes():
  assert hlo.shape_bytes('f32[2,128,256]{2,1,0}') == 2 * 128 * 256 * 4
  assert hlo.shape_bytes('(f32[], bf16[4,4]{1,0}, /*index=2*/pred[3])') == 4 + 32 + 3


def test_loop_trip_counts_multiply_collectives():
  """A psum over tp inside a 3-step scan inside a 2-step scan counts 6 times."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(MESH), ('dp', 'pp', 'tp'))

  def body(x):
    inner = lambda c, _: (jax.lax.psum(jnp.sin(c), 'tp'), None)
    outer = lambda c, _: (jax.lax.scan(inner, c, length=3)[0], None)
    return jax.lax.scan(outer, x, length=2)[0]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P('dp', 'pp'), out_specs=P('dp', 'pp')))
  text = f.lower(jnp.ones((2 * 64, 2 * 32), jnp.float32)).compile().as_text()
  colls = [c for c in hlo.collectives(hlo.parse_hlo(text), MESH) if c['kind'] == 'all-reduce']
  assert sum(c['count'] for c in colls) == 6 and {c['axes'] for c in colls} == {'tp'}
  assert sum(c['buffer_bytes'] for c in colls) == 6 * 64 * 32 * 4
  assert sum(c['wire_bytes'] for c in colls) == 6 * 64 * 32 * 4 * 2 * (2 - 1) / 2


# --- the tiny model under (dp, pp, tp) = (2, 2, 2) --------------------------------------------
@pytest.fixture(scope='module')
def tiny():
  cfg = config.load_config('tiny')
  return assemble.inspect(cfg)


def _check(result, what):
  return next(c for c in result['checks'] if c['what'].startswith(what))


def test_tiny_expected_numbers_by_hand(tiny):
  """The expectations themselves, counted by hand for tiny: L=4, h=256, s=128, m=4, p=t=d=2,
  b = 16 / 4 micro-batches / 2 dp shards = 2 sequences, fp32."""
  e, bsh = tiny['expected'], 2 * 128 * 256 * 4
  assert e['bsh_bytes'] == bsh
  # tp: 4 all-reduces * 2(t-1)/t * b*s*h*4 per layer per micro-batch; 2 layers per stage
  assert e['tp']['formula'] == 4 * 1.0 * bsh * 2 * 4  # m = 4 micro-batches
  assert e['tp']['spmd'] == 4 * 1.0 * bsh * 2 * 5  # v*m+p-1 = 5 iterations
  # pp: b*s*h forward + the same backward, per micro-batch (formula) or per iteration (SPMD)
  assert e['pp']['formula'] == 2 * 4 * bsh and e['pp']['spmd'] == 2 * 5 * bsh
  # dp: P_local = 2 layers of (2 norms of 256 + (q,o 256*256 + k,v 256*128 + mlp 3*256*768) / tp)
  #            + embedding and head (vocab 256 / tp) + final norm
  p_local = 2 * (512 + (2 * 65536 + 2 * 32768 + 3 * 256 * 768) // 2) + 2 * 128 * 256 + 256
  assert e['p_local_bytes'] == 4 * p_local
  # The batch outside the loop splits over (dp, pp): each pp rank's embedding, head and final norm
  # gradients are partial, summed over dp*pp = 4 (2*3/4); the layers' over dp (2*1/2).
  shared = 2 * 128 * 256 + 256
  assert e['dp']['formula'] == 2 * (2 - 1) / 2 * 4 * (p_local - shared) + 2 * 3 / 4 * 4 * shared


def test_tiny_pipeline_ring_bytes(tiny):
  """The ring carries b*s*h per iteration each way: (v*m+p-1)/m = 5/4 of the paper's count,
  because every stage computes and sends in every iteration, bubble included."""
  c = _check(tiny, 'pipeline ring')
  assert c['measured'] == pytest.approx(c['spmd'], rel=0.05)
  assert c['measured'] / c['formula'] == pytest.approx(5 / 4, rel=0.05)


def test_tiny_tensor_parallel_forward_bytes(tiny):
  """Forward: exactly the Megatron count, 2 all-reduces of b*s*h per layer per iteration."""
  c = _check(tiny, 'tp collectives in the layers (forward)')
  assert c['measured'] == pytest.approx(c['spmd'], rel=0.05)


def test_tiny_tensor_parallel_bytes_match_megatron(tiny):
  """Forward and backward: 4 all-reduces of b*s*h per layer per iteration (fused QKV and
  gate/up projections sum their input gradients over tp once each)."""
  c = _check(tiny, 'tp collectives in the layers (fwd+bwd)')
  assert c['measured'] == pytest.approx(c['spmd'], rel=0.05)


def test_tiny_data_parallel_gradient_bytes_are_the_parameters(tiny):
  """Every gradient all-reduced over dp is a parameter this device holds, once per step."""
  c = _check(tiny, 'gradient bytes reduced')
  assert c['measured'] == pytest.approx(tiny['expected']['p_local_bytes'], rel=0.01)


def test_tiny_data_parallel_bytes_match_formula(tiny):
  c = _check(tiny, 'gradient bytes reduced')
  assert c['measured'] == pytest.approx(c['formula'], rel=0.05)


def test_tiny_memory_and_flops(tiny):
  e, m = tiny['expected'], tiny['memory_bytes']
  # arguments: fp32 params + Adam m and v (3 copies of P_local) + the batch shard: five 4-byte
  # arrays (inputs, targets, segment ids, positions; float32 weights)
  state = 3 * e['p_local_bytes']
  assert state <= m['argument'] <= state + 5 * 8 * 128 * 4 + 1024
  assert m['alias'] >= state  # the state is donated: outputs reuse the argument buffers
  # executed matmul FLOPs include the bubble (5/4 on the layers), never less than the model's
  assert 1.0 < tiny['flops'] / tiny['model_flops'] < 5 / 4 + 0.05
  assert tiny['flops_xla_cost_analysis'] < tiny['flops']  # XLA counts loop bodies once
  lines = inspection.summary_lines(tiny)
  assert lines and 'per device' in lines[0]


@pytest.mark.slow
def test_cli_json():
  proc = subprocess.run(
    [sys.executable, '-m', 'jax3d.inspect', '--config=configs/tiny.py', '--json'],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    env={k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'} | {'PYTHONPATH': REPO},
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = json.loads(proc.stdout)
  assert set(out['memory_bytes']) >= {'argument', 'temp', 'output'} and out['flops'] > 0
  assert set(out['comm_bytes']) >= {'dp', 'pp', 'tp'} and out['comm_bytes']['pp'] > 0


def test_cli_config_error_exits_2():
  proc = subprocess.run(
    [sys.executable, '-m', 'jax3d.inspect', '--config=configs/tiny.py', '--config.mesh.tp=3'],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
    env={**os.environ, 'PYTHONPATH': REPO},
  )
  assert proc.returncode == 2 and proc.stderr.startswith('error: ') and 'mesh' in proc.stderr


# Every layout of the equivalence matrix (tests/test_equivalence.py) and every remat policy: the
# compiled step's tp, pp and dp bytes equal what the formulas say it executes, within 5% (no
# communication the layout does not need). Compile only, nothing runs.
@pytest.mark.parametrize(
  'dp,pp,tp,remat',
  [
    (dp, pp, tp, 'none')
    for dp, pp, tp in [(8, 1, 1), (4, 1, 2), (2, 1, 4), (4, 2, 1), (2, 4, 1), (1, 4, 2), (2, 2, 2)]
  ]
  + [(2, 2, 2, r) for r in ('dots', 'attn', 'full', 'stage')]
  + [(4, 1, 2, 'full'), (1, 2, 4, 'full')],
)
def test_collective_bytes_equal_the_formulas_at_every_layout(dp, pp, tp, remat):
  _collectives_equal_the_formulas(dp, pp, tp, remat, sp=False)


def _collectives_equal_the_formulas(dp, pp, tp, remat, sp):
  over = {'mesh.dp': dp, 'mesh.pp': pp, 'mesh.tp': tp, 'pipeline.microbatches': 2 * pp, 'train.remat': remat}
  over['model.n_kv_heads'] = max(tp, 2)  # tiny has 2 KV heads; tp must divide them
  over['train.sequence_parallel'] = 'true' if sp else 'false'
  r = assemble.inspect(config.load_config('tiny', over))
  for c in r['checks']:
    if 'spmd' in c:
      assert c['measured'] == pytest.approx(c['spmd'], rel=0.05, abs=1.0), (c['what'], c)
  return r


# Sequence parallelism: the layers' tp traffic is all-gathers and reduce-scatters, counted by
# formulas.TP_SP_HALVES; the ring moves 1/tp; the only collectives besides are the all-gathers
# over tp of the pipeline's outputs and of its inputs' gradient (the 'tp_edges' check).
@pytest.mark.parametrize(
  'dp,pp,tp,remat',
  [(4, 1, 2, 'none'), (2, 1, 4, 'none'), (1, 4, 2, 'none'), (2, 2, 2, 'none'), (1, 2, 4, 'full')]
  + [(2, 2, 2, r) for r in ('dots', 'attn', 'full', 'stage')],
)
def test_sequence_parallel_collective_bytes_equal_the_formulas(dp, pp, tp, remat):
  r = _collectives_equal_the_formulas(dp, pp, tp, remat, sp=True)
  layers = [c for c in r['collectives'] if c['in_layers']]
  assert {(c['axes'], c['kind']) for c in layers} <= {
    (TP, k) for k in ('all-gather', 'reduce-scatter', 'all-reduce')
  }
  # What is left of the all-reduces: the RMSNorm scales' gradients (the norms see 1/tp of the rows).
  reduced = sum(c['wire_bytes'] for c in layers if c['kind'] == 'all-reduce')
  assert reduced < 0.01 * sum(c['wire_bytes'] for c in layers)
