"""python -m jax3d.plan: choose dp, pp, tp, micro-batches, remat for a config on a GPU cluster.

  python -m jax3d.plan --config=configs/llama3_70b.py --nodes=8 --gpus-per-node=8 --gpu-memory-gb=80
  ... --json | --emit (the --config.* overrides for jax3d.train) | --verify (XLA's own figure)

The search follows the tutorial's rules (seed digest rows 13-14): tp at most the GPUs of one node
(tensor parallelism stays on NVLink), pp a divisor of what remains, dp fills the rest; every
candidate is priced with `costmodel.estimate`, so "few layers -> more tp" falls out of the bubble.
When nothing fits, the out-of-memory ladder is printed with this config's numbers.
"""
from __future__ import annotations

import json
import sys

from absl import flags

from jax3d.config import ConfigError, load_config, validate
from jax3d.tools import costmodel
from jax3d.tools.costmodel import GB, Hardware, estimate
from jax3d.tools.planner import LAYOUT_KEYS, Candidate, apply, explain, oom_ladder, search, table, verify

# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
flags.DEFINE_string('config', 'configs/tiny.py', 'config file (or a name in configs/)')
flags.DEFINE_integer('nodes', 1, 'nodes in the cluster')
flags.DEFINE_integer('gpus_per_node', 8, 'GPUs per node (one NVLink domain)')
flags.DEFINE_float('gpu_memory_gb', 80.0, 'memory per GPU, GB')
flags.DEFINE_float('peak_tflops', Hardware.peak_tflops, 'dense bf16 peak per GPU, TFLOP/s (H100/H200 SXM)')
flags.DEFINE_float('efficiency', Hardware.efficiency, 'achievable share of peak for the matmuls')
flags.DEFINE_float('intra_node_gbps', Hardware.intra_gbps, 'GB/s per GPU per direction inside a node')
flags.DEFINE_float('inter_node_gbps', Hardware.inter_gbps, 'GB/s per GPU across nodes')
flags.DEFINE_float('overlap', Hardware.overlap, 'share of the backward pass that hides the dp all-reduce')
flags.DEFINE_integer('top', 10, 'fitting layouts to list')
flags.DEFINE_bool('fixed', False, 'price only the layout the config sets (no search)')
flags.DEFINE_bool('json', False, 'print the layouts as JSON')
flags.DEFINE_bool('emit', False, 'print the --config overrides of the best layout for jax3d.train')
flags.DEFINE_bool('verify', False, 'compile the best layout on fake CPU devices; print XLA\'s memory')
FLAGS = flags.FLAGS


def run(argv: list[str]) -> int:
  overrides = {}
  rest = [argv[0]]
  for a in argv[1:]:
    if a.startswith('--config.'):
      key, _, value = a[len('--config.'):].partition('=')
      overrides[key] = value
    elif a.startswith('--'):  # --gpus-per-node and --gpus_per_node alike
      name, eq, value = a[2:].partition('=')
      rest.append('--' + name.replace('-', '_') + eq + value)
    else:
      rest.append(a)
  try:
    FLAGS(rest)
  except flags.Error as e:
    raise ConfigError(str(e)) from None
  for name in ('nodes', 'gpus_per_node', 'gpu_memory_gb', 'peak_tflops', 'efficiency',
               'intra_node_gbps', 'inter_node_gbps'):
    if FLAGS[name].value <= 0:
      raise ConfigError(f'--{name}={FLAGS[name].value} is invalid: must be positive')
  hw = Hardware(nodes=FLAGS.nodes, gpus_per_node=FLAGS.gpus_per_node, memory_gb=FLAGS.gpu_memory_gb,
                peak_tflops=FLAGS.peak_tflops, efficiency=FLAGS.efficiency,
                intra_gbps=FLAGS.intra_node_gbps, inter_gbps=FLAGS.inter_node_gbps, overlap=FLAGS.overlap)
  if FLAGS.verify:  # before jax starts a backend: n fake CPU devices (unless XLA_FLAGS is set)
    from jax3d.parallel import mesh as mesh_lib
    mesh_lib.use_fake_cpu_devices(hw.n_devices)
  cfg = load_config(FLAGS.config, overrides)
  if FLAGS.fixed:
    plan = validate(cfg, hw.n_devices)
    ranked = [Candidate({k: cfg[k.split('.')[0]][k.split('.')[1]] for k in LAYOUT_KEYS},
                        estimate(cfg, plan, hw.memory_gb * GB, hw))]
  else:
    ranked = search(cfg, hw)
  fit, shown = [], set()
  for c in ranked:  # one row per layout; ZeRO-1 on/off ties are shown once (the less memory)
    key = tuple(v for k, v in c.overrides.items() if k != 'train.shard_optimizer')
    if c.est.fits and key not in shown and len(fit) < FLAGS.top:
      shown.add(key)
      fit.append(c)
  # For the meshes where nothing fits: the variant that needs least memory, and by how much.
  seen, misfits = {(c.plan.dp, c.plan.pp, c.plan.tp) for c in ranked if c.est.fits}, []
  for c in sorted(ranked, key=lambda c: c.est.total_bytes):
    key = (c.plan.dp, c.plan.pp, c.plan.tp)
    if not c.est.fits and key not in seen:
      seen.add(key)
      misfits.append(c)
  name = FLAGS.config.rsplit('/', 1)[-1].removesuffix('.py')
  if FLAGS.json:
    print(json.dumps([dict(c.row(), rank=i) for i, c in enumerate(fit, 1)] +
                     [dict(c.row(), rank=None) for c in misfits], indent=1))
  elif FLAGS.emit and fit:
    print(' '.join(f'--config.{k}={v}' for k, v in fit[0].overrides.items()))
  else:
    n_params = costmodel.param_count(cfg)
    print(f'{name}: {n_params / 1e9:.2f}B' if n_params >= 1e9 else f'{name}: {n_params / 1e6:.1f}M', end='')
    print(f' parameters, batch '
          f'{cfg.train.global_batch_size} x {cfg.train.seq_len} tokens, on {hw.nodes} x '
          f'{hw.gpus_per_node} GPUs of {hw.memory_gb:g} GB ({hw.peak_tflops:g} TFLOP/s at '
          f'{hw.efficiency:.0%}, {hw.intra_gbps:g} GB/s in a node, {hw.inter_gbps:g} GB/s across)')
    if fit:
      print(f'\nLayouts that fit ({sum(c.est.fits for c in ranked)} of {len(ranked)}), best first:')
      print('\n'.join(table(fit)))
      print('\n' + '\n'.join(explain(cfg, fit[0], ranked, hw)))
      print(f'  Estimate: {fit[0].est.describe()}')
    if misfits:
      print('\nLayouts that do not fit (least memory of each dp/pp/tp):')
      for c in misfits[:12]:
        p = c.plan
        print(f'  dp={p.dp} pp={p.pp} tp={p.tp} (m={p.microbatches}, remat={c.est.remat}): {c.est.reason}')
  if not fit:
    worst = min(ranked, key=lambda c: c.est.total_bytes)
    if not FLAGS.json:
      print('\n' + '\n'.join(oom_ladder(apply(cfg, worst.overrides), worst.plan, hw.memory_gb * GB, hw)))
    raise ConfigError(f'no layout of {name} fits {hw.nodes} x {hw.gpus_per_node} GPUs of '
                      f'{hw.memory_gb:g} GB: the smallest {worst.est.reason}')
  if FLAGS.verify:
    best = fit[0]
    print('\n' + '\n'.join(verify(apply(cfg, best.overrides), best.plan)))
  return 0


def main(argv=None) -> int:
  try:
    return run(list(argv if argv is not None else sys.argv))
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2


if __name__ == '__main__':
  sys.exit(main())
