"""Command-line plumbing shared by the jax3d commands: `--config=PATH`, `--config.KEY=VALUE`
overrides (unknown keys rejected), other `--flag=value` options, and exit status 2 on bad input."""
from __future__ import annotations

import dataclasses
import sys


@dataclasses.dataclass
class Args:
  cfg: object
  config_path: str
  flags: dict
  positional: list


def fail(err) -> int:
  print(f'error: {err}', file=sys.stderr)
  return 2


def parse(argv: list[str], extra: dict | None = None):
  """Returns Args, or an exit status (2) after printing one line."""
  from jax3d import config as config_lib
  flags = dict(extra or {})
  config_path, overrides, positional = None, {}, []
  for arg in argv:
    if not arg.startswith('--'):
      positional.append(arg)
      continue
    key, eq, value = arg[2:].partition('=')
    if key in ('help', 'h'):
      print(__import__('__main__').__doc__ or '')
      return 0
    if not eq:
      if key in flags and isinstance(flags[key], bool):
        value = 'true'
      else:
        return fail(f'--{key} needs a value (--{key}=VALUE)')
    if key == 'config':
      config_path = value
    elif key.startswith('config.'):
      overrides[key[len('config.'):]] = value
    elif key in flags:
      flags[key] = (value.lower() in ('1', 'true', 'yes')) if isinstance(flags[key], bool) else value
    else:
      return fail(f'unknown flag --{key}; valid: --config, --config.KEY=VALUE'
                  + ''.join(f', --{k}' for k in flags))
  try:
    cfg = config_lib.load_config(config_path, overrides)  # set_key converts to each default's type
  except config_lib.ConfigError as e:
    return fail(e)
  return Args(cfg, config_path or config_lib.default_config_path(), flags, positional)


def prepare_devices(n: int = 8) -> None:
  """On a machine without an accelerator, expose n fake CPU devices unless XLA_FLAGS is set; on a
  GPU machine, add the communication-overlap XLA flags (jax3d/gpu.py; JAX3D_NO_GPU_FLAGS=1: off)."""
  from jax3d.parallel.mesh import use_fake_cpu_devices
  from jax3d.training import gpu
  use_fake_cpu_devices(n)
  gpu.apply_gpu_flags()
