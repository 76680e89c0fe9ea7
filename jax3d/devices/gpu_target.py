"""GPUs that are not attached: the devices of a compile-only CUDA topology (`--target=h100x8`).

  devices = gpu_target.devices(gpu_target.parse('h100x16'))   # 2 nodes x 8 "NVIDIA H100 80GB HBM3"
  assemble.build(cfg, devices); assemble.compile_train_step(s)  # XLA:GPU's real pipeline, no GPU

JAX's CUDA plugin (`pip install 'jax3d[cuda12]'`) compiles for GPUs described by a target
description (`GpuTargetConfigProto` text: SM count, shared memory, memory size, compute capability,
cuDNN version), the ones in gpu_specs/ beside this file. The compiled executable is the program a
real node runs: cuDNN attention chosen or not, fusions, the latency-hiding schedule, and its
`memory_analysis()`. The topology is nodes x 8 GPUs (`1xNODESx8`); fewer than 8 is one node.

Compiler options: the ones a real GPU run sets through XLA_FLAGS (gpu_flags.GPU_FLAGS), passed to this
compile directly (`compiler_options`), and autotuning off (there is no GPU to time kernels on).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys
from importlib import resources
from typing import TYPE_CHECKING

from jax3d.devices import gpu_flags
from jax3d.errors import ConfigError

if TYPE_CHECKING:
  import jax

GPUS_PER_NODE = 8
SPECS = {  # --target kind -> its description in gpu_specs/
  'h100': 'h100_sxm.txtpb',
  'h200': 'h200_sxm.txtpb',
  'a100': 'a100_sxm_80gb.txtpb',
}
FORM = (
  'KINDxN: KIND one of '
  + ', '.join(SPECS)
  + f'; N GPUs, 1 to {GPUS_PER_NODE} or a multiple of {GPUS_PER_NODE}'
)


@dataclasses.dataclass(frozen=True)
class Target:
  """A compile target: `n` GPUs of `kind`, in nodes of up to 8."""

  kind: str
  n: int

  @property
  def nodes(self) -> int:
    return max(1, self.n // GPUS_PER_NODE)

  @property
  def per_node(self) -> int:
    return min(self.n, GPUS_PER_NODE)

  @property
  def name(self) -> str:
    return f'{self.kind}x{self.n}'

  def spec_text(self) -> str:
    return _spec_text(self.kind)

  @property
  def memory_bytes(self) -> int:
    """Each GPU's memory, as its description gives it."""
    return int(re.search(r'device_memory_size:\s*(\d+)', self.spec_text()).group(1))

  @property
  def device_kind(self) -> str:
    return re.search(r'device_description_str:\s*"([^"]*)"', self.spec_text()).group(1)


@functools.cache
def _spec_text(kind: str) -> str:
  """The description of `kind` (package data), read once."""
  return resources.files('jax3d.devices').joinpath('gpu_specs', SPECS[kind]).read_text()


def _match(text: str) -> Target | None:
  m = re.fullmatch(r'([a-z0-9]+)x(\d+)', str(text).strip().lower())
  n = int(m.group(2)) if m else 0
  if not m or m.group(1) not in SPECS or n < 1 or (n > GPUS_PER_NODE and n % GPUS_PER_NODE):
    return None
  return Target(m.group(1), n)


def is_target(text: str) -> bool:
  """Whether `text` names a target ('' does not)."""
  return _match(text) is not None


def parse(text: str, setting: str = '--target') -> Target:
  """'h100x8' -> Target('h100', 8); a ConfigError naming `setting`, the value and the form."""
  target = _match(text)
  if target is None:
    raise ConfigError(f'{setting}={text!r} is invalid: {FORM} (e.g. h100x8, h200x16)')
  return target


def plugin_installed() -> bool:
  """Whether a CUDA plugin for jax is installed (decided without importing it)."""
  return any(gpu_flags.find_spec(p) for p in gpu_flags.CUDA_PLUGINS)


def devices(target: Target) -> list[jax.Device]:
  """The target's GPUs as jax devices of a compile-only topology (nothing runs on them). A
  ConfigError (exit 2) naming what to install when jax has no CUDA plugin."""
  if not plugin_installed():
    raise ConfigError(
      f"--target={target.name} needs JAX's CUDA plugin to compile for GPUs: pip install 'jax3d[cuda12]' "
      "(or 'jax[cuda12]'); no GPU is needed"
    )
  hide_unusable_plugin()
  from jax.experimental import topologies

  try:
    topo = topologies.get_topology_desc(
      target.kind,
      'cuda',
      target_config=target.spec_text(),
      topology=f'1x{target.nodes}x{target.per_node}',
    )
  except NotImplementedError as e:  # the plugin tried to start its GPU backend and failed
    raise ConfigError(
      f'--target={target.name}: the CUDA plugin for jax started without a GPU and cannot compile ({e}); '
      'set JAX_PLATFORMS=cpu before jax starts (the jax3d commands do)'
    ) from None
  return list(topo.devices)


def compiler_options() -> dict[str, bool | int | str]:
  """The XLA options of a real GPU run (gpu_flags.GPU_FLAGS) for a compile-only one, autotuning off;
  typed as XLA's options are (a bool, an int)."""
  typed = lambda v: {'true': True, 'false': False}.get(v, int(v) if v.isdigit() else v)
  opts = {k: typed(v) for k, v in (f.lstrip('-').split('=', 1) for f in gpu_flags.GPU_FLAGS)}
  return opts | {'xla_gpu_shard_autotuning': False}


def hide_unusable_plugin(env: dict | None = None) -> bool:
  """On a machine with JAX's CUDA plugin installed but no GPU (a deviceless compile), sets
  JAX_PLATFORMS=cpu unless the user chose platforms: the plugin's start-up check would fail with a
  traceback, and the compile-only topology needs no GPU backend. Returns whether it did."""
  env = os.environ if env is None else env
  if env.get('JAX_PLATFORMS') or not plugin_installed() or gpu_flags.gpu_present(env):
    return False
  env['JAX_PLATFORMS'] = 'cpu'
  if 'jax' in sys.modules:  # imported, perhaps not started: its setting, read from the environment once
    sys.modules['jax'].config.update('jax_platforms', 'cpu')
  return True
