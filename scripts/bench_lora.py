"""LoRA against the full fine-tune: memory per device and step time on the same layout.

  python scripts/bench_lora.py [--variants=full,r8,r64,r8:drop0.1,r8:bf16,r8:int8] [--steps=4]
                               [--layout=2,2,2] [--shape=100m|tiny] [--out=bench_lora.json]

For each variant (the full fine-tune; LoRA rN at rank N, every projection adapted, the base in
float32 like the full run's weights, or with `:bf16` / `:int8` the base stored in bfloat16 / int8
(jax3d/model/quant.py), with `:dropP` lora.dropout P) the train step is compiled for the layout and
run `--steps` times on one batch of random tokens from the seed's parameters (the first step
dropped from the time); printed and written as JSON: the trainable
parameters, XLA's compiled bytes per device (arguments = the train state, temp = gradients and
activations, total), the state's parameter and optimizer bytes per device (shard shape x itemsize),
the planner's estimate of the same (jax3d/planning/memory_model.py), the median step time, and
the loss after the last step with its difference from the first LoRA row's (the same rank over a
float32 base: what a bf16 or int8 base, or dropout, changes).
Shape 100m: 12 layers, d_model 768, 12 heads, d_ff 2048, vocabulary 32000 (about 134M
parameters), 8 rows of 128 tokens, micro-batches 2, remat none, float32; fake CPU devices.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jax3d.cli import prepare_devices  # noqa: E402

prepare_devices(8)
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jax3d import assemble, config as config_lib  # noqa: E402
from jax3d.model import lora  # noqa: E402
from jax3d.planning import memory_model  # noqa: E402

MiB = 2**20
SHAPES = {
  '100m': {
    'model.n_layers': 12,
    'model.d_model': 768,
    'model.n_heads': 12,
    'model.n_kv_heads': 12,
    'model.d_ff': 2048,
    'model.vocab_size': 32000,
    'train.seq_len': 128,
    'train.global_batch_size': 8,
  },
  'tiny': {
    'model.n_layers': 4,
    'model.d_model': 64,
    'model.n_heads': 4,
    'model.n_kv_heads': 4,
    'model.d_ff': 128,
    'model.vocab_size': 256,
    'train.seq_len': 16,
    'train.global_batch_size': 8,
  },
}


def local_bytes(tree: object) -> int:
  """Bytes per device of an abstract tree with shardings (shard shape x itemsize)."""
  return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def variant(name: str) -> dict:
  """'full' | 'rN[:bf16|:int8|:dropP]...' -> its config keys."""
  if name == 'full':
    return {'lora.rank': 0}
  rank, *opts = name.split(':')
  out = {'lora.rank': int(rank.removeprefix('r'))}
  for o in opts:
    if o.startswith('drop'):
      out['lora.dropout'] = float(o.removeprefix('drop'))
    else:
      out['lora.base_dtype'] = {'bf16': 'bfloat16', 'int8': 'int8', 'f32': 'float32'}[o]
  return out


def run(shape: str, layout: tuple[int, int, int], name: str, steps: int) -> dict:
  """One variant: compiled memory, state bytes, estimate, step time, final loss."""
  dp, pp, tp = layout
  keys = variant(name)
  over = SHAPES[shape] | {'mesh.dp': dp, 'mesh.pp': pp, 'mesh.tp': tp, 'train.remat': 'none'}
  over |= {'pipeline.microbatches': 2 if pp > 1 else 1} | keys
  if keys['lora.rank']:  # (a full fine-tune sets no lora.* key: it would act on nothing)
    over['lora.alpha'] = 2.0 * keys['lora.rank']
  cfg = config_lib.load_config('tiny', over)
  s = assemble.build(cfg, jax.devices()[: dp * pp * tp])
  bench = assemble.benchmark(s, steps)
  mem = bench['compiled'].memory
  params = s.abstract_state['params']
  moments = [optax.tree.get(s.abstract_state['opt_state'], k) for k in ('mu', 'nu')]
  est = memory_model.breakdown(s.cfg, s.plan, flash=False)
  return {
    'variant': f'LoRA {name}' if keys['lora.rank'] else 'full fine-tune',
    'trainable': lora.count(lora.trainable(s.dims, params)[0]),
    'arguments_mib': mem['argument'] / MiB,
    'temp_mib': mem['temp'] / MiB,
    'total_mib': mem['total'] / MiB,
    'params_mib': local_bytes(params) / MiB,
    'optimizer_mib': local_bytes(moments) / MiB,
    'est_params_mib': est['params'] / MiB,
    'est_optimizer_mib': est['optimizer'] / MiB,
    'est_grads_mib': est['grads'] / MiB,
    'compile_s': bench['compile_s'],
    'step_s': statistics.median(bench['step_times'][1:]),
    'loss': float(bench['metrics']['loss']),
  }


def table(rows: list[dict]) -> str:
  head = (
    '| variant | trainable | total MiB/dev | args | temp | params | Adam | est. params | est. Adam | step s '
    '| loss | loss - r f32 |'
  )
  out = [head, '|' + '---|' * 12]
  ref = next((r['loss'] for r in rows if r['variant'] != 'full fine-tune'), None)
  for r in rows:
    out.append(
      f'| {r["variant"]} | {r["trainable"]:,} | {r["total_mib"]:.1f} | {r["arguments_mib"]:.1f} | '
      f'{r["temp_mib"]:.1f} | {r["params_mib"]:.1f} | {r["optimizer_mib"]:.1f} | {r["est_params_mib"]:.1f} | '
      f'{r["est_optimizer_mib"]:.1f} | {r["step_s"]:.3f} | {r["loss"]:.5f} | {r["loss"] - ref:+.2e} |'
    )
  return '\n'.join(out)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--variants', default='full,r8,r64,r8:drop0.1,r8:bf16,r8:int8')
  ap.add_argument('--steps', type=int, default=4)
  ap.add_argument('--layout', default='2,2,2')
  ap.add_argument('--shape', choices=tuple(SHAPES), default='100m')
  ap.add_argument('--out', default='bench_lora.json')
  a = ap.parse_args(argv)
  layout = tuple(int(x) for x in a.layout.split(','))
  if len(layout) != 3 or a.steps < 2:
    ap.error('--layout is dp,pp,tp and --steps at least 2 (the first step is dropped)')
  rows = [run(a.shape, layout, v, a.steps) for v in a.variants.split(',')]
  print(f'shape {a.shape}, layout dp,pp,tp = {a.layout}, {a.steps} steps (first dropped), per device:')
  print(table(rows))
  with open(a.out, 'w') as f:
    json.dump({'shape': a.shape, 'layout': layout, 'rows': rows}, f, indent=2)
  return 0


if __name__ == '__main__':
  sys.exit(main())
