"""What one train step costs before it runs: memory, FLOPs and every collective, per device.

  python -m jax3d.inspect --config=configs/tiny.py [--config.mesh.tp=4 ...] [--json]
  python -m jax3d.inspect --config=configs/llama3_8b.py --target=h100x8 [--hlo=step.hlo]

The real train step is compiled ahead of time with abstract inputs (nothing is allocated), then
read three ways: `memory_analysis()` (argument / temp / output / alias bytes), the optimised HLO
text for the collectives and the attention kernel, and the HLO's matmuls for FLOPs. XLA's own
`cost_analysis()` counts a while loop's body once, whatever its trip count, so it under-counts a
scanned model; we report it but multiply every op (matmul or collective) by the trip counts of the
loops around it.

`--target=KINDxN` (h100, h200, a100; N GPUs in nodes of 8): the step compiled by XLA:GPU for that
many GPUs, on this machine, with no GPU (jax3d/devices/gpu_target.py; needs
`pip install 'jax3d[cuda12]'`): the program a GPU node runs, its memory against the GPU's, and
whether it fits. `--hlo=FILE` writes the optimised HLO text.

Bytes are per device per optimizer step, defined in jax3d/analysis/hlo.py: "buffer" is the HLO shape a
device holds, "wire" what it sends with a ring algorithm (the formulas are wire bytes).
"""

from __future__ import annotations

import json
import sys

from jax3d import cli
from jax3d.devices import gpu_target

FLAGS = {
  'json': cli.Flag(bool, False, 'print the result as one JSON object'),
  'target': cli.TARGET,
  'hlo': cli.Flag(str, '', "write the compiled step's optimised HLO text to this file", cli.ranges.NEW_FILE),
}


def main(argv: list[str] | None = None) -> int:
  """Runs `python -m jax3d.inspect` with argv (default sys.argv[1:]); returns the exit status."""
  return cli.run_command(_inspect, cli.parse(sys.argv[1:] if argv is None else argv, __doc__, FLAGS))


def _inspect(args: cli.Args) -> int:
  f = args.flags
  target = gpu_target.parse(f['target']) if f['target'] else None
  cli.prepare_devices()  # before jax starts: 8 fake CPU devices unless XLA_FLAGS is set
  from jax3d import assemble
  from jax3d.analysis import inspection

  devices = gpu_target.devices(target) if target else None
  options = gpu_target.compiler_options() if target else None
  compiled = assemble.compile_train_step(assemble.build(args.cfg, devices), options)
  result = compiled.analysis()
  if target is not None:
    result = inspection.with_device_memory(result, target.memory_bytes)
  if f['hlo']:
    with open(f['hlo'], 'w') as fh:
      fh.write(compiled.executable.as_text())
  if f['json']:
    colls = [{k: v for k, v in c.items() if k != 'op_name'} for c in result['collectives']]
    print(json.dumps({k: v for k, v in result.items() if k != 'collectives'} | {'collectives': colls}))
  else:
    print(inspection.render(result))
    if f['hlo']:
      print(f'\noptimised HLO written to {f["hlo"]}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
