"""Validation of a config into its typed form and the frozen run plan: every check runs before jax
traces or compiles anything, and raises `ConfigError` with one line naming the setting, its value
and what would be valid. The checks themselves are data: each key's range beside its default
(jax3d/config/keys.py), the settings against each other in jax3d/config/rules.py; this module runs
them in order, converts the ConfigDict once its keys are checked into the typed `Config` the rules
and the code read (forms.typed), and resolves the mesh between the model's checks and the
layout's."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any, NoReturn

import ml_collections

from jax3d.config import forms
from jax3d.config.forms import base_config
from jax3d.config.keys import Config
from jax3d.config.ranges import has_kind
from jax3d.config.rules import LAYOUT_CHECKS, MODEL_CHECKS, Failure, padded_vocab
from jax3d.config.values import Switch, step_list
from jax3d.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """The validated layout and batch sizes of a run: mesh axes, pipeline schedule, accumulation,
  global batch, sequence length and the padded vocabulary, with the numbers derived from them."""

  dp: int
  pp: int
  tp: int
  microbatches: int
  repeats: int
  grad_accum: int
  global_batch: int
  seq_len: int
  vocab_padded: int
  nan_steps: tuple[int, ...] = ()  # train.inject_nan_at, parsed (a fault drill)
  sequence_parallel: bool = False  # train.sequence_parallel, resolved: on only with tp > 1
  skip_bubbles: bool | None = None  # pipeline.skip_bubbles; None = auto (decided by the devices)
  cp: int = 1  # mesh.cp: context parallel, devices sharing each row's tokens
  ep: int = 1  # mesh.ep: expert parallel, devices splitting the experts (data parallel outside them)

  @property
  def n_devices(self) -> int:  # dp * ep * cp * pp * tp
    return self.dp * self.ep * self.cp * self.pp * self.tp

  @property
  def chunk_batch(self) -> int:  # sequences per accumulation chunk
    return self.global_batch // self.grad_accum

  @property
  def micro_batch(self) -> int:  # sequences per micro-batch (all dp shards together)
    return self.chunk_batch // self.microbatches

  @property
  def pp_batch_split(self) -> str | None:
    """How the batch outside the pipeline's loop (embedding, head, loss) splits over pp, so that
    each device does 1/(dp*pp) of that work: 'rows' (each micro-batch's rows over dp*pp), 'micro'
    (whole micro-batches over pp, where a micro-batch's rows do not divide; not with sequence
    parallelism, where XLA then adds a tp all-gather of the loop's input and its gradient), or
    None (every pp rank computes its dp shard's whole batch there)."""
    if self.micro_batch % (self.dp * self.pp) == 0:
      return 'rows'
    micro = self.pp > 1 and self.microbatches % self.pp == 0 and not self.sequence_parallel
    return 'micro' if micro else None

  @property
  def zero_ranks(self) -> int:  # ranks ZeRO shards over and gradients are reduced over: dp * cp
    return self.dp * self.cp

  @property
  def iterations(self) -> int:  # pipeline loop trips: v*m + p - 1
    return self.repeats * self.microbatches + self.pp - 1

  @property
  def bubble(self) -> float:  # idle (wasted) share of the pipeline loop: (p-1)/(v*m+p-1)
    return (self.pp - 1) / self.iterations

  @property
  def tokens_per_step(self) -> int:  # tokens per optimizer step, all devices together
    return self.global_batch * self.seq_len


def _fail(key: str, value: Any, valid: str) -> NoReturn:
  raise ConfigError(f'{key}={value!r} is invalid: {valid}')


def resolve_mesh(dp: int, pp: int, tp: int, n_devices: int, cp: int = 1, ep: int = 1) -> tuple[int, int, int]:
  """Fills one -1 axis with the devices left over; checks dp*ep*cp*pp*tp == n_devices."""
  _check_range('mesh.cp', cp)
  _check_range('mesh.ep', ep)
  extra = {name: v for name, v in (('cp', cp), ('ep', ep)) if v > 1}  # the optional axes
  cp *= ep  # they count alike here
  sizes = {'mesh.dp': dp, 'mesh.pp': pp, 'mesh.tp': tp}
  for k, v in sizes.items():
    _check_range(k, v)
  free = [k for k, v in sizes.items() if v == -1]
  if len(free) > 1:
    raise ConfigError(f'{" and ".join(f"{k}=-1" for k in free)}: at most one mesh axis may be -1')
  fixed = cp * math.prod(v for v in sizes.values() if v != -1)
  if free:
    if n_devices % fixed:
      raise ConfigError(
        f'{free[0]}=-1 cannot be filled: the other axes use {fixed} devices, '
        f'which does not divide the {n_devices} visible devices'
      )
    sizes[free[0]] = n_devices // fixed
  total = cp * math.prod(sizes.values())
  if total != n_devices:
    cp_words = (''.join(f'{k}*' for k in extra), ''.join(f'{v}*' for v in extra.values()))
    raise ConfigError(
      f'mesh dp*{cp_words[0]}pp*tp = {sizes["mesh.dp"]}*{cp_words[1]}{sizes["mesh.pp"]}*{sizes["mesh.tp"]} = '
      f'{total}, but {n_devices} devices are visible (use -1 on one axis to fill)'
    )
  return sizes['mesh.dp'], sizes['mesh.pp'], sizes['mesh.tp']


def _raise_first(failures: Iterable[Failure]) -> None:
  for failure in failures:
    if failure is not None:
      _fail(*failure)


def _check_range(key: str, value: Any) -> None:
  """ConfigError unless `value` has the key's type and is in its declared range (keys.py)."""
  kind, rng = forms.kinds()[key], forms.ranges()[key]
  if not (has_kind(value, kind) and rng.ok(value)):
    _fail(key, value, rng.words(kind))


def check_ranges(cfg: ml_collections.ConfigDict) -> None:
  """Every key of `cfg` against its declared type and range (keys.py): ConfigError naming the
  first key outside, or a key jax3d does not know or that the config lacks."""
  for key in forms.ranges():
    section, name = key.split('.')
    if section not in cfg or name not in cfg[section]:
      raise ConfigError(f'the config has no key {key} (start a config from jax3d.config.base_config())')
    _check_range(key, cfg[section][name])
  for section, node in cfg.items():
    for name in node.keys() if isinstance(node, ml_collections.ConfigDict) else ['']:
      if f'{section}.{name}' not in forms.ranges():
        known = sorted(k for k in forms.ranges() if k.startswith(f'{section}.')) or sorted(
          forms.base_config()
        )
        raise ConfigError(
          f'unknown config key {f"{section}.{name}".rstrip(".")!r}; valid here: {", ".join(known)}'
        )


def checked(cfg: ml_collections.ConfigDict) -> Config:
  """cfg's keys checked against their ranges (`check_ranges`) and converted into the typed `Config`:
  for a command that reads settings but builds no layout (`jax3d.batch`)."""
  check_ranges(cfg)
  return forms.typed(cfg)


# Settings that act only beside another: (keys, whether that other setting is on, what turns it on).
# One of the keys set away from its default while the other is off is refused, never ignored.
DORMANT = (
  (
    ('lora.targets', 'lora.alpha', 'lora.dropout'),
    lambda cfg: cfg.lora.rank > 0,
    'lora.rank > 0 (lora.rank=0 is no adapters: a full fine-tune)',
  ),
  (
    ('eval.tasks_every', 'eval.tasks_limit', 'eval.tasks_include_path', 'eval.tasks_num_fewshot'),
    lambda cfg: bool(cfg.eval.tasks),
    "eval.tasks (eval.tasks='' runs no task)",
  ),
  (('train.cp_strategy',), lambda cfg: cfg.mesh.cp > 1, 'mesh.cp > 1 (mesh.cp=1 splits no sequence)'),
  (
    (
      'moe.top_k',
      'moe.norm_topk_prob',
      'moe.d_expert',
      'moe.d_shared',
      'moe.capacity_factor',
      'moe.aux_loss_coef',
      'moe.z_loss_coef',
    ),
    lambda cfg: cfg.moe.num_experts > 0,
    'moe.num_experts > 0 (moe.num_experts=0 is a dense MLP)',
  ),
)


def _dormant(cfg: ml_collections.ConfigDict) -> Failure:
  """The first setting of DORMANT set while the setting it acts with is off."""
  defaults = base_config()
  for names, on, needs in DORMANT:
    for key in names:
      section, name = key.split('.')
      value, default = cfg[section][name], defaults[section][name]
      if value != default and not on(cfg):
        return key, value, f'its default {default!r}: it acts only with {needs}'
  return None


def validate(cfg: ml_collections.ConfigDict, n_devices: int) -> RunPlan:
  """Checks every setting against its range (`check_ranges`), then the settings against each other
  (MODEL_CHECKS, DORMANT) and against the device count (LAYOUT_CHECKS); returns the run plan."""
  return validated(cfg, n_devices)[1]


def validated(cfg: ml_collections.ConfigDict, n_devices: int) -> tuple[Config, RunPlan]:
  """`validate`, and the config in its typed form (what the build path hands to the code)."""
  c = checked(cfg)
  _raise_first(check(c) for check in MODEL_CHECKS)
  _raise_first([_dormant(cfg)])
  dp, pp, tp = resolve_mesh(c.mesh.dp, c.mesh.pp, c.mesh.tp, n_devices, c.mesh.cp, c.mesh.ep)
  _raise_first(check(c, dp, pp, tp) for check in LAYOUT_CHECKS)
  t, p_ = c.train, c.pipeline
  rows = t.global_batch_size // (dp * p_.microbatches * t.grad_accum) * t.seq_len
  plan = RunPlan(
    sequence_parallel=_sequence_parallel(
      t.sequence_parallel, rows, tp, c.mesh.cp, t.matmul_dtype, c.moe.num_experts
    ),
    cp=c.mesh.cp,
    ep=c.mesh.ep,
    dp=dp,
    pp=pp,
    tp=tp,
    microbatches=p_.microbatches,
    repeats=p_.repeats,
    grad_accum=t.grad_accum,
    global_batch=t.global_batch_size,
    seq_len=t.seq_len,
    vocab_padded=padded_vocab(c.model),
    nan_steps=step_list(t.inject_nan_at),
    skip_bubbles=None if p_.skip_bubbles is Switch.AUTO else p_.skip_bubbles is Switch.TRUE,
  )
  return c, plan


def _sequence_parallel(
  value: Switch, rows: int, tp: int, cp: int = 1, matmul_dtype: str = '', experts: int = 0
) -> bool:
  """train.sequence_parallel resolved: the rows a layer sees (a micro-batch's rows on one dp shard
  times seq_len, over mesh.cp: each cp rank's tokens) are split over tp, so tp must divide them;
  'auto' is on when it does, and off with FP8 matmuls (not built on the SP projections) or a
  mixture of experts (`experts` > 0: its statistics' rows ride outside SP's flattened rows)."""
  if value is Switch.FALSE or tp == 1 or (value is Switch.AUTO and (matmul_dtype == 'fp8' or experts)):
    return False
  per_cp = ' / mesh.cp' if cp > 1 else ''
  rows //= cp
  if rows % tp:
    if value is Switch.AUTO:
      return False
    _fail(
      'train.sequence_parallel',
      value.value,
      f'the rows of a layer (micro-batch rows per dp shard * train.seq_len{per_cp} = {rows}) must be '
      f'divisible by mesh.tp={tp}; use a micro-batch or seq_len that tp divides, or false',
    )
  return True
