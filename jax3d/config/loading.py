"""Loading `configs/*.py` with `--config.KEY=VALUE` overrides, each key checked and converted to
the type of its default."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import traceback
from collections.abc import Mapping
from typing import Any

import ml_collections

from jax3d.errors import ConfigError


def configs_dir() -> str:
  """The folder of the shipped configs, `jax3d/configs/` (package data, so a non-editable install
  has them too; the repository's top-level `configs` is a link to it)."""
  return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')


def default_config_path() -> str:
  """The config used when none is given: `configs/tiny.py`."""
  return os.path.join(configs_dir(), 'tiny.py')


def load_config(
  path: str | None = None, overrides: Mapping[str, Any] | None = None
) -> ml_collections.ConfigDict:
  """Loads `configs/NAME.py` (its `get_config()`), applies `{'mesh.tp': 4, ...}`, locks it.

  A path is read as given; a short name such as 'tiny' (or `configs/tiny.py` from outside the
  repository) is looked up among the shipped configs, `jax3d/configs/`.
  """
  path = path or default_config_path()
  if not os.path.exists(path):  # 'tiny', or 'configs/tiny.py' outside the repository: the shipped one
    name = os.path.basename(path) if os.path.dirname(path) == 'configs' else f'{path}.py'
    if os.path.exists(os.path.join(configs_dir(), name)):
      path = os.path.join(configs_dir(), name)
  if not os.path.exists(path):
    raise ConfigError(
      f'--config={path}: no such file (try configs/tiny.py, configs/gpt2_small.py, '
      'configs/llama3_8b.py or configs/llama3_70b.py)'
    )
  cfg = _run_config_file(path)
  cfg.lock()
  for key, value in (overrides or {}).items():
    set_key(cfg, key, value)
  return cfg


def _run_config_file(path: str) -> ml_collections.ConfigDict:
  """The ConfigDict of a config file's `get_config()`; ConfigError naming the file (and the line)
  when it cannot be read, fails, or gives no ConfigDict."""
  if os.path.isdir(path):
    raise ConfigError(f'--config={path}: a folder, not a config file (a .py file with get_config())')
  try:
    loader = importlib.machinery.SourceFileLoader('jax3d_user_config', path)  # whatever its suffix
    spec = importlib.util.spec_from_file_location('jax3d_user_config', path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    get_config = getattr(module, 'get_config', None)
    if not callable(get_config):
      raise ConfigError(
        f'--config={path}: defines no get_config() (a config file returns its ConfigDict from it)'
      )
    cfg = get_config()
  except ConfigError:
    raise
  except SyntaxError as e:
    line = f'line {e.lineno}: ' if e.lineno else ''
    raise ConfigError(f'--config={path}: {line}{e.msg} (a config file is Python)') from None
  except Exception as e:  # the file's own code failed: where, and how
    tb = traceback.extract_tb(e.__traceback__)
    line = next(
      (f'line {t.lineno}: ' for t in reversed(tb) if os.path.abspath(t.filename) == os.path.abspath(path)), ''
    )
    raise ConfigError(f'--config={path}: {line}{type(e).__name__}: {e}') from None
  if not isinstance(cfg, ml_collections.ConfigDict):
    raise ConfigError(
      f'--config={path}: get_config() returned {type(cfg).__name__}, not an ml_collections.ConfigDict '
      '(start from jax3d.config.base_config())'
    )
  return cfg


def set_key(cfg: ml_collections.ConfigDict, dotted: str, value: Any) -> None:
  """Sets `cfg.a.b = value`, rejecting keys that do not exist (with the valid ones listed)."""
  *parents, leaf = dotted.split('.')
  node = cfg
  for i, name in enumerate(parents):
    if not isinstance(node, ml_collections.ConfigDict) or name not in node:
      raise ConfigError(
        f'unknown config key {".".join(parents[: i + 1])!r}; valid sections: {", ".join(sorted(cfg.keys()))}'
      )
    node = node[name]
  if leaf not in node:
    raise ConfigError(f'unknown config key {dotted!r}; valid keys here: {", ".join(sorted(node.keys()))}')
  current = node[leaf]
  if isinstance(value, bool) and isinstance(current, str):  # train.sequence_parallel=True
    value = str(value).lower()
  if isinstance(value, str) and not isinstance(current, str):
    try:
      if isinstance(current, bool):
        if value.lower() not in ('1', '0', 'true', 'false', 'yes', 'no'):
          raise ValueError(value)
        value = value.lower() in ('1', 'true', 'yes')
      elif isinstance(current, int):
        value = int(value)
      elif isinstance(current, float):
        value = float(value)
    except ValueError:
      raise ConfigError(
        f'{dotted}={value!r} is invalid: expected a {type(current).__name__} (the default is {current!r})'
      ) from None
  with node.unlocked():
    node[leaf] = value
