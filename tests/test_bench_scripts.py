"""scripts/bench_vs_maxtext.py without running a trainer: layouts, both trainers' arguments, FLOPs
from jax3d's formulas, the roof's weighting, the parsing of jax3d's output and the table."""

import importlib.util
import os
import sys

import pytest

from jax3d import config as config_lib
from jax3d.model import formulas

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
  'bench_vs_maxtext', os.path.join(ROOT, 'scripts', 'bench_vs_maxtext.py')
)
bvm = importlib.util.module_from_spec(_spec)
sys.modules['bench_vs_maxtext'] = bvm  # dataclasses look their module up
_spec.loader.exec_module(bvm)


def test_layouts_parse_and_label():
  lay = bvm.parse_layout('2x2x2m4')
  assert (lay.dp, lay.pp, lay.tp, lay.microbatches, lay.n_kv_heads) == (2, 2, 2, 4, 4)
  assert lay.label == '2x2x2 m4'
  assert bvm.parse_layout('1x2x4').microbatches == 4  # pipelined: 4 micro-batches by default
  assert bvm.parse_layout('8x1x1').microbatches == 1
  gqa = bvm.parse_layout('4x1x2kv2')
  assert gqa.label == '4x1x2 kv2' and gqa.shape().n_kv_heads == 2
  for bad in ('4x2', '4x1x1', '2x2x2m8', '1x1x8', '4x1x2kv3', '2x4x1m3'):
    with pytest.raises(ValueError, match='--layouts'):
      bvm.parse_layout(bad)
  assert [x.spec for x in bvm.parse_args([]).layout_list] == bvm.DEFAULT_LAYOUTS.split(',')


def test_bad_flags_exit_2(capsys):
  for argv in (['--layouts=3x1x1'], ['--dtypes=float16'], ['--rounds=0']):
    with pytest.raises(SystemExit) as e:
      bvm.parse_args(argv)
    assert e.value.code == 2
  assert '--layouts' in capsys.readouterr().err


def test_jax3d_arguments_are_valid_config_keys():
  """Every override the benchmark passes is a key of jax3d's config, of the right type."""
  for spec in ('4x1x2', '2x4x1m4', '4x1x2kv2'):
    lay = bvm.parse_layout(spec)
    args = bvm.jax3d_args(lay, 'bfloat16', 20, '/tmp/w')
    assert args[:3] == ['-m', 'jax3d.train', '--workdir=/tmp/w']
    overrides = dict(a[len('--config.') :].split('=', 1) for a in args[3:])
    cfg = config_lib.load_config('tiny', overrides)
    plan = config_lib.validate(cfg, bvm.N_DEVICES)
    assert (plan.dp, plan.pp, plan.tp, plan.microbatches) == (lay.dp, lay.pp, lay.tp, lay.microbatches)
    assert cfg.train.compute_dtype == 'bfloat16' and cfg.train.param_dtype == 'float32'
    assert cfg.model.n_kv_heads == lay.n_kv_heads and cfg.log.every == 1 and cfg.checkpoint.every == 0


def test_maxtext_arguments():
  assert bvm.maxtext_args(bvm.parse_layout('4x1x2'), 'float32', 20) == ['4', '2', '1', 'float32']
  assert bvm.maxtext_args(bvm.parse_layout('2x4x1m4'), 'bfloat16', 20) == [
    '2',
    '1',
    '4',
    'bfloat16',
    'num_pipeline_microbatches=4',
    'num_layers_per_pipeline_stage=1',
  ]
  assert bvm.maxtext_args(bvm.parse_layout('4x1x2kv2'), 'float32', 30)[4:] == [
    'base_num_kv_heads=2',
    'steps=30',
  ]


def test_flops_come_from_the_formulas():
  s = bvm.Shape()
  f = bvm.step_flops(s)
  assert f['model'] == formulas.flops_per_token(s, s.seq_len) * s.tokens
  assert 1.3 < f['executed'] / f['model'] < 4 / 3  # one forward of the layers (not the head) again
  assert bvm.step_flops(bvm.parse_layout('4x1x2kv2').shape())['model'] < f['model']


def test_weighted_roof():
  s = bvm.Shape()
  keys = {f'{m}x{k}x{n}' for _, (m, k, n), _ in bvm.gemm_shapes(s)}
  assert bvm.weighted_roof(dict.fromkeys(keys, 100e9), s) == pytest.approx(100e9)
  slow = dict.fromkeys(keys, 100e9) | {'1024x1024x256': 50e9}  # the down projection at half speed
  assert 50e9 < bvm.weighted_roof(slow, s) < 100e9


def test_jax3d_output_parsing():
  records = [{'event': 'start', 'step': 0}] + [
    {'step': i, 'step_time_s': 0.0 if i == 1 else (1.0 if i <= 5 else 0.5 + i / 1000)} for i in range(1, 21)
  ]
  med, n = bvm.median_step(records)
  assert n == 15 and med == pytest.approx(0.513)
  lines = [
    (2.0, 'jax3d: 8 cpu devices, mesh dp=4 x pp=1 x tp=2'),
    (4.0, 'initialised from seed 0'),
    (9.5, '  compiled the train step in 5.2 s'),
    (10.5, '  first step (compile + run): 1.0 s'),
    (10.6, 'step      1/20  loss 7.4'),
  ]
  assert bvm.startup_split(lines) == {'summary': 2.0, 'init': 4.0, 'compiled': 9.5, 'first_step': 10.5}


def test_table():
  lays = [bvm.parse_layout('4x1x2'), bvm.parse_layout('2x2x2m4')]
  runs = []
  for rnd in (1, 2):
    for lay in lays:
      for who, step in (('jax3d', 0.4), ('maxtext', 0.5)):
        r = {'trainer': who, 'spec': lay.spec, 'dtype': 'float32', 'round': rnd, 'step_s': step * rnd}
        r.update(first_step_s=8.0, startup={'summary': 2.0, 'init': 3.0, 'compiled': 7.0, 'first_step': 8.0})
        runs.append(r)
  # the roof before round 1, after round 1 and after round 2: each run gets its round's mean
  roofs = [{'weighted': {'float32 kv4': {'roof': r * 1e9}}} for r in (80, 120, 60)]
  rows = bvm.summarize(runs, lays, ['float32'], roofs)
  assert rows[0]['ratio'] == pytest.approx([0.8, 0.8]) and rows[0]['jax3d']['median_step_s'] == pytest.approx(
    0.6
  )
  table = bvm.format_table(rows)
  assert (
    table.count('\n') == 3
    and '| 4x1x2 | float32 | 0.500, 1.000 | 0.400, 0.800 | 0.80, 0.80 (medians: 0.80) |' in table
  )
  # 29.0 GFLOP per step at the median 0.6 s; against the rounds' roofs 100 and 90 GFLOP/s, round 1
  # ran at 29.0 / 0.4 / 100 = 72.5%, round 2 at 29.0 / 0.8 / 90 = 40.3%: the median 56%
  assert rows[0]['jax3d']['roof_flops'] == pytest.approx([100e9, 90e9])
  assert f'{29.0 / 0.6:.1f} (56%)' in table
  roof_lines = bvm.format_roof(
    [dict(r, per_gemm={'float32 1x2x3': {'1dev': 1e9, '2dev': 2e9}}) for r in roofs], ['float32']
  )
  assert 'roof float32 kv4 (before round 1, after each round): 80.0, 120.0, 60.0  (median 80.0)' in '\n'.join(
    roof_lines
  )
  assert 'compile 4.0 s' in bvm.format_startup(runs)[0]
  assert 'warning' not in bvm.format_load([dict(r, load=2.5) for r in runs], cores=2)
  assert 'warning' in bvm.format_load([dict(r, load=8.0) for r in runs], cores=2)
  only = bvm.summarize([r for r in runs if r['trainer'] == 'jax3d'], lays, ['float32'], None)
  assert '| - |' in bvm.format_table(only)


def test_cpu_profile_breakdown():
  """--cpu-profile: perf report lines of the device threads, by kind, in CPU ms per step (samples
  at 499 Hz / steps); other threads (the Python main thread: compilation) are left out."""
  report = '\n'.join(
    [
      '# Overhead  Samples  Command  Shared Object  Symbol',
      '    40.00%      998  tf_XLAEigen  libjax_common.so   [.] ynn::dot_fp32_5x64x1_1x16x1_avx512',
      '    20.00%      499  tf_XLAEigen  [JIT] tid 26146    [.] 0x00007f88dd660092',
      '    10.00%      499  tf_XLAEigen  libjax_common.so   [.] Eigen::internal::gebp_kernel<float>',
      '     5.00%      499  tf_XLAEigen  libjax_common.so   [.] ynn::transpose_x2048_avx',
      '     5.00%      499  tf_XLAEigen  libjax_common.so   [.] xla::cpu::(anonymous namespace)::ReduceScatter<11>',
      '     5.00%      499  tf_XLAEigen  libc.so.6          [.] __memmove_avx512_unaligned_erms',
      '     5.00%      499  tf_XLAEigen  [kernel.kallsyms]  [k] finish_task_switch.isra.0',
      '     5.00%      499  tf_XLAEigen  libjax_common.so   [.] xla::cpu::ThunkExecutor::Execute',
      '     5.00%     4990  python       libjax_common.so   [.] ynn::dot_fp32_5x64x1_1x16x1_avx512',
    ]
  )
  got = bvm.cpu_breakdown(report, steps=10)
  want = dict.fromkeys(bvm.CPU_KINDS, 100.0)  # 499 samples = 1 s over 10 steps
  want['YNNPACK matmul'] = 200.0
  assert got == pytest.approx(want)
  rows = [{'spec': '4x1x2', 'dtype': 'float32', 'trainer': t, 'cpu_ms': got} for t in ('jax3d', 'maxtext')]
  table = bvm.format_cpu(rows)
  assert table[-2].startswith('| 4x1x2 | float32 | maxtext | 200 | 100 |') and table[-1].endswith('| 900 |')


# scripts/bench_zero3.py: its flags, the bytes of a sharded tree and the tables, nothing compiled
_spec_z3 = importlib.util.spec_from_file_location(
  'bench_zero3', os.path.join(ROOT, 'scripts', 'bench_zero3.py')
)
bz3 = importlib.util.module_from_spec(_spec_z3)
_spec_z3.loader.exec_module(bz3)


def test_zero3_flags(capsys):
  a = bz3.parse_args([])
  assert a.only == list(bz3.PARTS) and a.rounds >= 1 and a.steps >= 2
  assert bz3.parse_args(['--only=chunks,time']).only == ['chunks', 'time']
  for bad in (
    ['--only=bytes,memory'],
    ['--only='],
    ['--steps=1'],
    ['--rounds=0'],
    ['--rounds=x'],
    ['--dp=2'],
  ):
    with pytest.raises(SystemExit) as e:
      bz3.parse_args(bad)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'error' in err  # one line


def test_zero3_shard_bytes():
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((2,), ('dp',), devices=jax.devices()[:2])
  tree = {'w': jax.ShapeDtypeStruct((8, 6), 'float32'), 'b': jax.ShapeDtypeStruct((6,), 'bfloat16')}
  sh = {'w': NamedSharding(mesh, P('dp')), 'b': NamedSharding(mesh, P())}
  assert bz3.shard_bytes(tree, sh) == 4 * 6 * 4 + 6 * 2


def test_zero3_tables():
  b = dict(params_mib=96.0, optimizer_mib=192.0, argument_mib=288.1, argument_check=True, temp_mib=400.0)
  b |= dict(est_params_mib=96.0, est_optimizer_mib=192.0, est_grads_mib=160.0, est_activations_head_mib=465.7)
  rows = [b | {'dp': 1, 'shard_params': False, 'gather': None, 'state_vs_dp1': 1.0}]
  rows.append(
    b | {'dp': 8, 'shard_params': True, 'gather': 'layer', 'params_mib': 12.0, 'state_vs_dp1': 0.125}
  )
  lines = bz3.format_bytes(rows)
  assert len(lines) == 4 and '| 8 | layer | 12.0 (96.0) | 192.0 (192.0) | 0.125 |' in lines[3]
  c = {
    'layout': '1x1x1',
    'temp_mib': 100.0,
    'est_head_mib': 50.0,
    'est_activations_mib': 20.0,
    'est_grads_mib': 5.0,
  }
  lines = bz3.format_chunks(
    [c | {'loss_chunks': 1, 'temp_vs_1': 1.0}, c | {'loss_chunks': 8, 'temp_vs_1': 0.5}]
  )
  assert lines[3] == '| 1x1x1 | 8 | 100.0 | 0.500 | 50.0 | 75.0 |'
  times = {'off': [[0.1, 0.3], [0.2, 0.2]], 'layer': [[0.2, 0.2], [0.1, 0.1]]}
  (row,) = bz3.summarize_times('8x1x1', times, 'off')
  assert row['ratio'] == pytest.approx(0.15 / 0.2) and row['round_ratios'] == pytest.approx([1.0, 0.5])
  assert bz3.format_time([row])[2] == '| 8x1x1 | layer / off | 200.0 | 150.0 | 0.75 | 0.50-1.00 |'


# scripts/bench_vs_maxtext_gpu.py: its HLO reading on a small module, the table, the shapes' keys and
# its refusal without MaxText's venv; nothing compiled (the 8 x H100 compiles need MaxText's venv)
_spec_gpu = importlib.util.spec_from_file_location(
  'bench_vs_maxtext_gpu', os.path.join(ROOT, 'scripts', 'bench_vs_maxtext_gpu.py')
)
bgpu = importlib.util.module_from_spec(_spec_gpu)
sys.modules['bench_vs_maxtext_gpu'] = bgpu  # dataclasses look their module up
_spec_gpu.loader.exec_module(bgpu)

# One loop of 4 trips holding a matmul as a dot and as a cuBLAS call, an fp32 all-gather, a bf16
# reduce-scatter and cuDNN's attention (forward, backward) plus a Pallas preprocess; an all-reduce
# outside it. Per device per call of ENTRY:
#   matmuls     2 x (2*16*32*512) x 4                                = 4,194,304 FLOPs
#   attention   forward 4*b*n*t*s*h/2 = 4*2*4*128*128*64/2 = 16,777,216 per call, 4 calls;
#               backward 2.5 x that, 4 calls; the preprocess none
#   all-gather  f32[64,32] gathered over 8: 65,536 bytes x 4; reduce-scatter bf16[512,32]: 32,768 x 4;
#               all-reduce f32[8]: 32
GPU_HLO = """HloModule m, num_partitions=8

%cond (c: (s32[])) -> pred[] {
  %c = (s32[]) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

%body (b: (s32[])) -> (s32[]) {
  %b = (s32[]) parameter(0)
  %w = f32[64,32]{1,0} parameter(1)
  %x = bf16[16,512]{1,0} parameter(2)
  %ag = f32[512,32]{1,0} all-gather(%w), replica_groups=[1,8]<=[8], dimensions={0}
  %d = f32[16,32]{1,0} dot(%x, %ag), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %cb = f32[16,32]{1,0} custom-call(%x, %ag), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %g = bf16[512,32]{1,0} parameter(3)
  %rs = bf16[64,32]{1,0} reduce-scatter(%g), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  %q = bf16[2,128,4,64]{3,2,1,0} parameter(4)
  %k = bf16[2,128,2,64]{3,2,1,0} parameter(5)
  %fa = (bf16[2,4,128,64]{3,1,2,0}, f32[2,4,128]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %k), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(f)/attention"}
  %fb = (bf16[2,4,128,64]{3,1,2,0}, u8[0]{0}) custom-call(%q, %k, %k), custom_call_target="__cudnn$fmhaSoftmaxBackward", metadata={op_name="jit(f)/attention"}
  %pre = f32[2,4,128]{2,1,0} custom-call(%q, %q), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/preprocess_backward/pallas_call"}
  ROOT %t = (s32[]) tuple(%ci)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %t0 = (s32[]) parameter(1)
  %ar = f32[8]{0} all-reduce(%a), replica_groups=[1,8]<=[8], to_apply=%add
  %wl = (s32[]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %r = f32[8]{0} copy(%ar)
}
"""


def test_gpu_hlo_reading():
  r = bgpu.read_hlo(GPU_HLO)
  assert r['matmul_flops'] == 2 * (2 * 16 * 32 * 512) * 4
  fwd = 4 * 2 * 4 * 128 * 128 * 64 / 2
  att = r['attention']
  assert (att['forward']['calls'], att['backward']['calls'], att['preprocess']['calls']) == (4, 4, 4)
  assert att['forward']['flops'] == fwd * 4 and att['backward']['flops'] == 2.5 * fwd * 4
  assert att['preprocess']['flops'] == 0 and att['forward']['k'] == [2, 128, 2, 64]  # K/V heads as given
  assert r['executed_flops'] == r['matmul_flops'] + 3.5 * fwd * 4
  c = r['collectives']
  assert c['all-gather']['buffer_bytes'] == 65536 * 4 and c['all-gather']['dtypes'] == {'f32': 65536 * 4}
  assert c['reduce-scatter']['buffer_bytes'] == 32768 * 4 and set(c['reduce-scatter']['dtypes']) == {'bf16'}
  assert c['all-reduce']['buffer_bytes'] == 32 and c['all-reduce']['count'] == 1
  assert r['collective_bytes'] == 65536 * 4 + 32768 * 4 + 32 and r['unknown_trip_counts'] == []


def test_gpu_table():
  j = bgpu.read_hlo(GPU_HLO) | {'peak_bytes': 3 * 2**30, 'wall_s': 30.0}
  m = dict(
    j, peak_bytes=2 * 2**30, collectives={k: v for k, v in j['collectives'].items() if k != 'all-reduce'}
  )
  m['collective_bytes'] = j['collective_bytes'] / 2
  table = {w.strip(): (a, b, ratio) for w, a, b, ratio in bgpu.rows(j, m)}
  assert table['peak GiB'] == ('3.00', '2.00', '1.50')
  assert table['executed FLOPs (matmuls + attention), PF'][2] == '1.00'
  assert table['all-reduce, GiB (by dtype)'] == ('0.0 (none)', '0.0 (none)', '-')  # MaxText has none
  assert table['attention kernel calls per step (forward / backward)'][:2] == ('4 / 4', '4 / 4')
  lines = bgpu.format_table('Tiny', bgpu.rows(j, m))
  assert lines[0] == 'Tiny, per device per step:' and lines[4] == '| peak GiB | 3.00 | 2.00 | 1.50 |'
  big = {'dtypes': {'f32': 80.04 * 2**30, 'bf16': 65.9 * 2**30, 's32': 1.0}}
  assert bgpu._dtypes(big) == 'f32 80.0, bf16 65.9'


def test_gpu_shapes_are_the_same_work():
  """Each shape's jax3d overrides are valid keys giving its tokens and accumulation; MaxText's batch
  per device and accumulation give the same tokens per step."""
  for shape in bgpu.SHAPES.values():
    args = shape.jax3d_args('/tmp/x.hlo', 'h100x8')
    assert args[:2] == ['-m', 'jax3d.inspect'] and '--target=h100x8' in args
    overrides = dict(a[len('--config.') :].split('=', 1) for a in args if a.startswith('--config.'))
    cfg = config_lib.load_config(shape.jax3d_config, overrides)
    plan = config_lib.validate(cfg, bgpu.N_GPUS)
    assert plan.global_batch * plan.seq_len == shape.tokens and plan.grad_accum == shape.grad_accum
    assert (plan.dp, plan.tp, plan.pp, cfg.train.shard_params, cfg.train.remat) == (8, 1, 1, True, 'full')
    mt = dict(a.split('=', 1) for a in shape.maxtext_args('run', '/tmp/mt'))
    rows = int(mt['per_device_batch_size']) * bgpu.N_GPUS * int(mt['gradient_accumulation_steps'])
    assert rows * int(mt['max_target_length']) == shape.tokens and mt['ici_fsdp_parallelism'] == '8'
  assert config_lib.load_config('llama3_8b', {}).model.n_kv_heads == 8
  assert bgpu.SHAPES['llama2_7b'].jax3d_overrides['model.n_kv_heads'] == 32  # Llama 2 7B: no GQA
  extra = bgpu.SHAPES['llama3_8b'].jax3d_args('/tmp/x.hlo', 'h100x8', ['train.grad_reduce_dtype=bfloat16'])
  assert '--config.train.grad_reduce_dtype=bfloat16' in extra  # --jax3d-config reaches jax3d


def test_gpu_refusals(tmp_path, capsys):
  """Without MaxText's venv (or its CUDA plugin), and with bad flags: one `error:` line, exit 2."""
  for argv in (
    [f'--maxtext-venv={tmp_path}'],
    ['--shapes=llama3_8b,gpt5'],
    ['--target=h100x16'],
    ['--target=tpu8'],
    ['--jax3d-config=train.grad_reduce_dtype'],
  ):
    with pytest.raises(SystemExit) as e:
      bgpu.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and err.startswith('error: '), err
  (tmp_path / 'bin').mkdir()
  (tmp_path / 'bin' / 'python').touch()
  (tmp_path / 'lib' / 'python3.12' / 'site-packages' / 'maxtext').mkdir(parents=True)
  with pytest.raises(SystemExit):
    bgpu.check_venv(str(tmp_path))
  assert "missing: JAX's CUDA plugin" in capsys.readouterr().err
  (tmp_path / 'lib' / 'python3.12' / 'site-packages' / 'jax_cuda12_plugin').mkdir()
  assert bgpu.check_venv(str(tmp_path)) == str(tmp_path / 'bin' / 'python')
