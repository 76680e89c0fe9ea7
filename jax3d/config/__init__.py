"""Configs: every key declared once with its type, default, range and meaning (keys.py; the
tri-states and enumerations in values.py, the ranges' vocabulary in ranges.py), loading
`configs/*.py` with overrides into a ConfigDict (loading.py), what the settings may be against each
other (rules.py), and validation into the typed `Config` the code reads and the frozen run plan
(validate.py, forms.py).

Every check runs before jax traces or compiles anything and raises `ConfigError` with one line
naming the setting, its value and what would be valid; the commands exit 2 on it. Nothing here
imports jax.
"""

from jax3d.config.forms import base_config, editable, ranges as key_ranges, typed
from jax3d.config.keys import Config
from jax3d.config.loading import configs_dir, default_config_path, load_config, set_key
from jax3d.config.rules import padded_vocab
from jax3d.config.validate import RunPlan, check_ranges, checked, resolve_mesh, validate, validated
from jax3d.config.values import (
  ATTENTION_IMPLS,
  DTYPES,
  GRAD_REDUCE_DTYPES,
  LORA_TARGETS,
  REMAT_POLICIES,
  SCHEDULES,
  SWITCH,
  Switch,
  lora_targets,
)
from jax3d.errors import ConfigError

__all__ = [
  'ATTENTION_IMPLS',
  'DTYPES',
  'GRAD_REDUCE_DTYPES',
  'LORA_TARGETS',
  'REMAT_POLICIES',
  'SCHEDULES',
  'SWITCH',
  'Config',
  'ConfigError',
  'RunPlan',
  'Switch',
  'base_config',
  'key_ranges',
  'check_ranges',
  'checked',
  'configs_dir',
  'default_config_path',
  'editable',
  'load_config',
  'lora_targets',
  'padded_vocab',
  'resolve_mesh',
  'set_key',
  'typed',
  'validate',
  'validated',
]
