"""A config's two forms: the ml_collections ConfigDict of `base_config()`, which config files and
`--config.KEY=VALUE` overrides edit (loading.py), and `Config` (keys.py), the frozen typed object
the code reads, made from a checked ConfigDict by `typed` once (validate.py). Both come from the one
declaration of each key in keys.py, as do the ranges and types the checks read."""

from __future__ import annotations

import copy
import dataclasses
import functools
import typing
from typing import Any

import ml_collections

from jax3d.config.keys import Config
from jax3d.config.ranges import Range
from jax3d.config.values import Switch


@functools.cache
def sections() -> dict[str, type]:
  """'mesh' -> Mesh, ..., in the order of `Config`."""
  hints = typing.get_type_hints(Config)
  return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


@functools.cache
def _types() -> dict[str, Any]:
  """'section.key' -> the key's declared type (int, float, bool, str, Switch or a Literal)."""
  return {f'{name}.{k}': t for name, cls in sections().items() for k, t in typing.get_type_hints(cls).items()}


def base_config() -> ml_collections.ConfigDict:
  """Every key jax3d understands, with its default; `configs/*.py` start from it."""
  return ml_collections.ConfigDict(Config().to_dict())


@functools.cache
def ranges() -> dict[str, Range]:
  """The valid range of every key, 'section.key' -> Range."""
  return {
    f'{name}.{f.name}': f.metadata['range']
    for name, cls in sections().items()
    for f in dataclasses.fields(cls)
  }


@functools.cache
def kinds() -> dict[str, type]:
  """The type of every key's value in the ConfigDict ('section.key' -> the type of its default)."""
  return {k: type(v) for k, v in _flat(Config().to_dict()).items()}


def _flat(d: dict) -> dict[str, Any]:
  return {f'{s}.{k}': v for s, section in d.items() for k, v in section.items()}


def typed(cfg: Config | ml_collections.ConfigDict) -> Config:
  """The typed, frozen form of a config whose keys have been checked (`validate.check_ranges`;
  `validate.validated` checks and converts): a Switch parsed from its word, a float key's int made
  a float. A `Config` is returned as it is."""
  if isinstance(cfg, Config):
    return cfg
  types = _types()

  def value(name: str, k: str) -> Any:
    v, t = cfg[name][k], types[f'{name}.{k}']
    return Switch.parse(v) if t is Switch else float(v) if t is float else v

  return Config(
    **{
      name: cls(**{f.name: value(name, f.name) for f in dataclasses.fields(cls)})
      for name, cls in sections().items()
    }
  )


def editable(cfg: Config | ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A locked ConfigDict copy of cfg, the form `set_key` edits and `validate` checks (cfg itself is
  left as it is): a `Config` written back, a ConfigDict copied."""
  if isinstance(cfg, Config):
    out = ml_collections.ConfigDict(cfg.to_dict())
    out.lock()
    return out
  return copy.deepcopy(cfg)
