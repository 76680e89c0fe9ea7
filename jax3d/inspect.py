"""What one train step costs before it runs: memory, FLOPs and every collective, per device.

  python -m jax3d.inspect --config=configs/tiny.py [--config.mesh.tp=4 ...] [--json]

The real train step is compiled ahead of time with abstract inputs (nothing is allocated), then
read three ways: `memory_analysis()` (argument / temp / output / alias bytes), the optimised HLO
text for the collectives, and the HLO's matmuls for FLOPs. XLA's own `cost_analysis()` counts a
while loop's body once, whatever its trip count, so it under-counts a scanned model; we report it
but multiply every op (matmul or collective) by the trip counts of the loops around it.

Bytes, defined once (all per device, per optimizer step):
  buffer bytes  the size of the HLO shape one device holds: the operand of an all-reduce or
                collective-permute, the gathered result of an all-gather, the scattered operand
                of a reduce-scatter.
  wire bytes    what a device sends with a ring algorithm on a group of n devices:
                all-reduce 2(n-1)/n * buffer, all-gather / reduce-scatter / all-to-all
                (n-1)/n * buffer, collective-permute 1 * buffer. The formulas in
                shared/docs/formulas.md are wire bytes, so the comparison uses those.
"""
from __future__ import annotations

import os
import sys

from jax3d.tools.inspection import inspect_step, render


def main(argv=None) -> int:
  import json
  argv = list(sys.argv[1:] if argv is None else argv)
  if os.environ.get('JAX_PLATFORMS', 'cpu') in ('cpu', ''):
    from jax3d.parallel import mesh as mesh_lib
    mesh_lib.use_fake_cpu_devices(8)
  from jax3d import config as config_lib
  path, overrides, as_json = None, {}, False
  try:
    for arg in argv:
      if arg == '--json':
        as_json = True
      elif arg.startswith('--config='):
        path = arg.split('=', 1)[1]
      elif arg.startswith('--config.') and '=' in arg:
        key, value = arg[len('--config.'):].split('=', 1)
        overrides[key] = value
      else:
        raise config_lib.ConfigError(f'unknown argument {arg!r} (use --config=PATH, --config.KEY=VALUE, --json)')
    cfg = config_lib.load_config(path, overrides)
    import jax
    plan = config_lib.validate(cfg, jax.device_count())
    result = inspect_step(cfg, plan)
  except config_lib.ConfigError as err:
    print(f'error: {err}', file=sys.stderr)
    return 2
  if as_json:
    print(json.dumps({k: v for k, v in result.items() if k != 'collectives'} |
                     {'collectives': [{k: v for k, v in c.items() if k != 'op_name'} for c in result['collectives']]}))
  else:
    print(render(result))
  return 0


if __name__ == '__main__':
  sys.exit(main())
