"""What one train step costs before it runs: memory, FLOPs and every collective, per device.

  python -m jax3d.inspect --config=configs/tiny.py [--config.mesh.tp=4 ...] [--json]

The real train step is compiled ahead of time with abstract inputs (nothing is allocated), then
read three ways: `memory_analysis()` (argument / temp / output / alias bytes), the optimised HLO
text for the collectives, and the HLO's matmuls for FLOPs. XLA's own `cost_analysis()` counts a
while loop's body once, whatever its trip count, so it under-counts a scanned model; we report it
but multiply every op (matmul or collective) by the trip counts of the loops around it.

Bytes are per device per optimizer step, defined in jax3d/analysis/hlo.py: "buffer" is the HLO shape a
device holds, "wire" what it sends with a ring algorithm (the formulas are wire bytes).
"""

from __future__ import annotations

import json
import sys

from jax3d import cli

FLAGS = {'json': cli.Flag(bool, False, 'print the result as one JSON object')}


def main(argv: list[str] | None = None) -> int:
  """Runs `python -m jax3d.inspect` with argv (default sys.argv[1:]); returns the exit status."""
  return cli.run_command(_inspect, cli.parse(sys.argv[1:] if argv is None else argv, __doc__, FLAGS))


def _inspect(args: cli.Args) -> int:
  cli.prepare_devices()  # before jax starts: 8 fake CPU devices unless XLA_FLAGS is set
  from jax3d import assemble
  from jax3d.analysis.inspection import render

  result = assemble.inspect(args.cfg)
  if args.flags['json']:
    colls = [{k: v for k, v in c.items() if k != 'op_name'} for c in result['collectives']]
    print(json.dumps({k: v for k, v in result.items() if k != 'collectives'} | {'collectives': colls}))
  else:
    print(render(result))
  return 0


if __name__ == '__main__':
  sys.exit(main())
