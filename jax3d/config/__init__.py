"""Configs: every key with its default (keys.py), loading `configs/*.py` with overrides
(loading.py), the valid range of each (keys.py, in the words of ranges.py), what the settings
may be against each other (rules.py), and validation into the frozen run plan
(validate.py).

Every check runs before jax traces or compiles anything and raises `ConfigError` with one line
naming the setting, its value and what would be valid; the commands exit 2 on it. Nothing here
imports jax.
"""

from jax3d.config.keys import base_config, ranges as key_ranges
from jax3d.config.loading import configs_dir, default_config_path, load_config, set_key
from jax3d.config.rules import (
  ATTENTION_IMPLS,
  DTYPES,
  GRAD_REDUCE_DTYPES,
  LORA_TARGETS,
  REMAT_POLICIES,
  SCHEDULES,
  SWITCH,
  lora_targets,
  padded_vocab,
)
from jax3d.config.validate import RunPlan, check_ranges, resolve_mesh, validate
from jax3d.errors import ConfigError

__all__ = [
  'ATTENTION_IMPLS',
  'DTYPES',
  'GRAD_REDUCE_DTYPES',
  'LORA_TARGETS',
  'REMAT_POLICIES',
  'SCHEDULES',
  'SWITCH',
  'ConfigError',
  'RunPlan',
  'base_config',
  'key_ranges',
  'check_ranges',
  'configs_dir',
  'default_config_path',
  'load_config',
  'lora_targets',
  'padded_vocab',
  'resolve_mesh',
  'set_key',
  'validate',
]
