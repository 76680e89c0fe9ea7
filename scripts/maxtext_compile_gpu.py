"""MaxText's train step compiled by XLA:GPU for GPUs that are not attached (run by
scripts/bench_vs_maxtext_gpu.py with MaxText's own Python; not a jax3d module, it imports MaxText).

  JAX_PLATFORMS=cpu DECOUPLE_GCLOUD=TRUE python scripts/maxtext_compile_gpu.py OUT SPEC TOPOLOGY OPTIONS \
      MAXTEXT_YML key=value ...

MaxText's own ahead-of-time path (`maxtext.trainers.pre_train.train_compile.main`) with two of its
functions replaced: `get_topology_mesh` (it builds GPU devices from jax.devices(), which needs a GPU)
takes the devices of JAX's compile-only CUDA topology TOPOLOGY ('1x1x8') described by SPEC (a
GpuTargetConfigProto text file: jax3d/devices/gpu_specs/), and `jit_and_compile` is MaxText's, with
the XLA options OPTIONS (a JSON object: jax3d's, jax3d/devices/gpu_target.py, so both trainers
compile with the same ones; an option this XLA does not know is dropped, as jax3d does).
Writes OUT.hlo (the optimised HLO text) and OUT.json (memory_analysis, the batch and timings).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from typing import Any

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('DECOUPLE_GCLOUD', 'TRUE')
import jax  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402
from maxtext.common.common_types import ShardMode  # noqa: E402
from maxtext.trainers.pre_train import train_compile  # noqa: E402
from maxtext.utils import maxtext_utils  # noqa: E402

RECORD: dict[str, Any] = {}


def get_topology_mesh(config: Any) -> Mesh:
  """train_compile.get_topology_mesh with the compile-only CUDA topology's devices."""
  with open(RECORD['spec']) as f:
    spec = f.read()
  kind = re.search(r'device_description_str:\s*"([^"]*)"', spec)
  topo = topologies.get_topology_desc(
    kind.group(1) if kind else 'gpu', 'cuda', target_config=spec, topology=RECORD['topology']
  )
  devices = topo.devices
  jax.config.update('jax_remove_size_one_mesh_axis_from_type', config.remove_size_one_mesh_axis_from_type)
  device_mesh = maxtext_utils.create_device_mesh(config, devices)
  axis_type = AxisType.Explicit if config.shard_mode == ShardMode.EXPLICIT else AxisType.Auto
  RECORD['device_kind'] = devices[0].device_kind
  RECORD['n_devices'] = len(devices)
  RECORD['mesh'] = dict(zip(config.mesh_axes, (int(d) for d in device_mesh.shape), strict=True))
  return Mesh(device_mesh, config.mesh_axes, axis_types=(axis_type,) * len(config.mesh_axes))


def jit_and_compile(
  func: Any,
  args: Any,
  kwargs: Any,
  mesh: Mesh,
  in_shardings: Any,
  out_shardings: Any,
  static_argnums: Any,
  donate_argnums: Any,
  config: Any,
  logical_axis_rules: Any,
) -> jax.stages.Compiled:
  """train_compile.jit_and_compile, timed, compiled with RECORD['compiler_options']."""
  mesh_ctx = mesh if config.enable_diloco else contextlib.nullcontext()
  t0 = time.perf_counter()
  with jax.set_mesh(mesh), mesh_ctx, logical_axis_rules:
    jitted = jax.jit(
      func,
      in_shardings=in_shardings,
      out_shardings=out_shardings,
      static_argnums=static_argnums,
      donate_argnums=donate_argnums,
    )
    lowered = jitted.lower(*args, **kwargs)
  t1 = time.perf_counter()
  options = RECORD['compiler_options']
  while True:
    try:
      compiled = lowered.compile(compiler_options=options)
      break
    except jax.errors.JaxRuntimeError as e:  # an option this XLA does not have
      unknown = re.search(r"No such compile option: '(\w+)'", str(e))
      if not unknown or unknown.group(1) not in options:
        raise
      del options[unknown.group(1)]
  RECORD.update(lower_s=t1 - t0, compile_s=time.perf_counter() - t1)
  RECORD['compiled'], RECORD['config'] = compiled, config
  return compiled


def main(argv: list[str]) -> int:
  """Compiles MaxText's step for argv = OUT SPEC TOPOLOGY OPTIONS MAXTEXT_YML key=value ..."""
  out, spec, topology, options = argv[:4]
  RECORD.update(spec=spec, topology=topology, compiler_options=json.loads(options))
  train_compile.get_topology_mesh = get_topology_mesh
  train_compile.jit_and_compile = jit_and_compile
  train_compile.main([sys.argv[0], *argv[4:]])
  exe, config = RECORD.pop('compiled'), RECORD.pop('config')
  with open(out + '.hlo', 'w') as f:
    f.write(exe.as_text())
  ma = exe.memory_analysis()
  memory = {
    k: int(getattr(ma, f'{k}_size_in_bytes', 0) or 0) for k in ('argument', 'output', 'alias', 'temp')
  }
  keys = (
    'per_device_batch_size',
    'gradient_accumulation_steps',
    'micro_batch_size_to_train_on',
    'global_batch_size_to_train_on',
    'max_target_length',
    'remat_policy',
    'attention',
    'dtype',
    'weight_dtype',
    'scan_layers',
    'opt_type',
    'num_vocab_tiling',
  )
  RECORD.update(
    trainer='maxtext',
    jax=jax.__version__,
    argv=argv[4:],
    memory=memory,
    config={k: str(getattr(config, k, None)) for k in keys},
    global_batch=int(config.global_batch_size_to_train_on),
    seq_len=int(config.max_target_length),
    grad_accum=int(config.gradient_accumulation_steps),
  )
  with open(out + '.json', 'w') as f:
    json.dump(RECORD, f, indent=1, default=str)
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
