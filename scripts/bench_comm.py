"""Per-device memory and bytes per step per mesh axis of each communication option, from the
compiled train step (jax3d.inspect: compiled.memory_analysis() and the optimised HLO's collectives).

  python scripts/bench_comm.py [--config=tiny] [--config.mesh.dp=8 --config.mesh.pp=1 ...]
                               [--json=bench_comm.json]

Options: plain (float32 all-reduce), zero1 (train.shard_optimizer), bf16 and int8
(train.grad_reduce_dtype), zero1+int8. Nothing runs: each step is compiled for abstract inputs.
The loss effect needs training runs (see docs/performance.md for the commands).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jax3d.cli import prepare_devices  # noqa: E402

prepare_devices(8)

OPTIONS = {
  'plain': {},
  'zero1': {'train.shard_optimizer': True},
  'bf16 reduce': {'train.grad_reduce_dtype': 'bfloat16'},
  'int8 reduce': {'train.grad_reduce_dtype': 'int8'},
  'zero1 + int8': {'train.shard_optimizer': True, 'train.grad_reduce_dtype': 'int8'},
}


def measure(path, overrides):
  import jax
  import numpy as np

  from jax3d import assemble, config as config_lib

  s = assemble.build(config_lib.load_config(path, overrides))
  plan, state = s.plan, s.abstract_state
  local = lambda tree: sum(
    int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize for a in jax.tree.leaves(tree)
  )
  r = assemble.compile_train_step(s).analysis()
  comm = {}
  for c in r['collectives']:
    comm[c['axes']] = comm.get(c['axes'], 0.0) + c['wire_bytes']
  return {
    'layout': f'dp={plan.dp} pp={plan.pp} tp={plan.tp}',
    'params_bytes': local(state['params']),
    'opt_state_bytes': local(state['opt_state']),
    'residual_bytes': local(state.get('grad_residual', {})),
    'argument_bytes': r['memory_bytes']['argument'],
    'temp_bytes': r['memory_bytes']['temp'],
    'peak_bytes': r['memory_bytes']['peak_estimate'],
    'comm_wire_bytes': comm,
    'dp_wire_bytes': sum(v for k, v in comm.items() if 'dp' in k.split('+')),
  }


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  path, over, out = 'tiny', {}, 'bench_comm.json'
  for a in argv:
    if a.startswith('--config='):
      path = a.split('=', 1)[1]
    elif a.startswith('--config.'):
      k, v = a[len('--config.') :].split('=', 1)
      over[k] = v
    elif a.startswith('--json='):
      out = a.split('=', 1)[1]
    else:
      raise SystemExit(f'unknown argument {a}')
  rows = {}
  mb = lambda x: f'{x / 2**20:.3f}'
  print(
    f'{"option":14s} {"params MiB":>10s} {"opt MiB":>9s} {"resid MiB":>9s} {"args MiB":>9s} '
    f'{"peak MiB":>9s}  dp-wire MiB (ratio)  wire MiB per axis group'
  )
  for name, extra in OPTIONS.items():
    r = rows[name] = measure(path, {**over, **extra})
    ratio = r['dp_wire_bytes'] / rows['plain']['dp_wire_bytes'] if rows['plain']['dp_wire_bytes'] else 0
    axes = ', '.join(f'{k} {mb(v)}' for k, v in sorted(r['comm_wire_bytes'].items()))
    print(
      f'{name:14s} {mb(r["params_bytes"]):>10s} {mb(r["opt_state_bytes"]):>9s} '
      f'{mb(r["residual_bytes"]):>9s} {mb(r["argument_bytes"]):>9s} {mb(r["peak_bytes"]):>9s}  '
      f'{mb(r["dp_wire_bytes"]):>8s} ({ratio:.3f})  {axes}',
      flush=True,
    )
  with open(out, 'w') as f:
    json.dump(
      {'config': path, 'overrides': over, 'layout': rows['plain']['layout'], 'options': rows}, f, indent=1
    )
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
