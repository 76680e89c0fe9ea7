"""Validation of a config into the frozen run plan: every check runs before jax traces or
compiles anything, and raises `ConfigError` with one line naming the setting, its value and what
would be valid."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NoReturn

import ml_collections

from jax3d.errors import ConfigError

DTYPES = ('float32', 'bfloat16')
REMAT_POLICIES = ('none', 'dots', 'attn', 'full', 'stage')
SCHEDULES = ('gpipe', 'circular')
GRAD_REDUCE_DTYPES = ('float32', 'bfloat16', 'int8')
ATTENTION_IMPLS = ('auto', 'xla', 'cudnn')
SWITCH = ('true', 'false', 'auto')  # the values of train.sequence_parallel, pipeline.skip_bubbles


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

  @property
  def n_devices(self) -> int:  # dp * pp * tp
    return self.dp * self.pp * self.tp

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


def resolve_mesh(dp: int, pp: int, tp: int, n_devices: int) -> tuple[int, int, int]:
  """Fills one -1 axis with the devices left over; checks dp*pp*tp == n_devices."""
  sizes = {'mesh.dp': dp, 'mesh.pp': pp, 'mesh.tp': tp}
  for k, v in sizes.items():
    if not isinstance(v, int) or (v < 1 and v != -1):
      _fail(k, v, 'a positive integer, or -1 for "all remaining devices"')
  free = [k for k, v in sizes.items() if v == -1]
  if len(free) > 1:
    raise ConfigError(f'{" and ".join(f"{k}=-1" for k in free)}: at most one mesh axis may be -1')
  fixed = math.prod(v for v in sizes.values() if v != -1)
  if free:
    if n_devices % fixed:
      raise ConfigError(
        f'{free[0]}=-1 cannot be filled: the other axes use {fixed} devices, '
        f'which does not divide the {n_devices} visible devices'
      )
    sizes[free[0]] = n_devices // fixed
  total = math.prod(sizes.values())
  if total != n_devices:
    raise ConfigError(
      f'mesh dp*pp*tp = {sizes["mesh.dp"]}*{sizes["mesh.pp"]}*{sizes["mesh.tp"]} = '
      f'{total}, but {n_devices} devices are visible (use -1 on one axis to fill)'
    )
  return sizes['mesh.dp'], sizes['mesh.pp'], sizes['mesh.tp']


def validate(cfg: ml_collections.ConfigDict, n_devices: int) -> RunPlan:
  """Checks every setting against the others and the device count; returns the run plan."""
  m, t, p_ = cfg.model, cfg.train, cfg.pipeline
  for key, value in (('train.compute_dtype', t.compute_dtype), ('train.param_dtype', t.param_dtype)):
    if value not in DTYPES:
      _fail(key, value, f'one of {", ".join(DTYPES)}')
  if t.remat not in REMAT_POLICIES:
    _fail('train.remat', t.remat, f'one of {", ".join(REMAT_POLICIES)}')
  if p_.schedule not in SCHEDULES:
    _fail('pipeline.schedule', p_.schedule, f'one of {", ".join(SCHEDULES)}')
  if t.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
    _fail('train.grad_reduce_dtype', t.grad_reduce_dtype, f'one of {", ".join(GRAD_REDUCE_DTYPES)}')
  if t.attention not in ATTENTION_IMPLS:
    _fail('train.attention', t.attention, f'one of {", ".join(ATTENTION_IMPLS)}')
  for key in (
    'n_layers',
    'd_model',
    'n_heads',
    'n_kv_heads',
    'd_ff',
    'vocab_size',
    'max_seq_len',
    'vocab_multiple',
  ):
    if not isinstance(m[key], int) or m[key] < 1:
      _fail(f'model.{key}', m[key], 'a positive integer')
  for key in ('global_batch_size', 'seq_len', 'grad_accum', 'max_bad_steps'):
    if not isinstance(t[key], int) or t[key] < 1:
      _fail(f'train.{key}', t[key], 'a positive integer')
  if not isinstance(t.steps, int) or t.steps < 0:
    _fail('train.steps', t.steps, 'an integer >= 0')
  if not isinstance(p_.microbatches, int) or p_.microbatches < 1:
    _fail('pipeline.microbatches', p_.microbatches, 'an integer >= 1')
  if not isinstance(p_.repeats, int) or p_.repeats < 1:
    _fail('pipeline.repeats', p_.repeats, 'an integer >= 1')
  # repeats > 1 *is* the circular schedule (GPipe is its v=1 case, one loop runs both), so it never
  # demands pipeline.schedule=circular as well.
  try:
    nan_steps = tuple(int(x) for x in str(t.inject_nan_at).split(',') if x.strip())
  except ValueError:
    _fail('train.inject_nan_at', t.inject_nan_at, 'comma-separated step numbers, e.g. "3,4"')
  if not isinstance(cfg.hardware.memory_gb, int | float) or cfg.hardware.memory_gb < 0:
    _fail('hardware.memory_gb', cfg.hardware.memory_gb, "a number of GB >= 0 (0 = the device's own limit)")
  if cfg.log.every < 1:
    _fail('log.every', cfg.log.every, 'an integer >= 1')
  if m.d_model % m.n_heads:
    _fail('model.d_model', m.d_model, f'a multiple of model.n_heads={m.n_heads}')
  if (m.d_model // m.n_heads) % 2:
    _fail(
      'model.d_model',
      m.d_model,
      f'd_model/n_heads must be even for rotary embeddings (it is {m.d_model // m.n_heads})',
    )
  if m.n_heads % m.n_kv_heads:
    _fail('model.n_kv_heads', m.n_kv_heads, f'a divisor of model.n_heads={m.n_heads}')
  if t.seq_len > m.max_seq_len:
    _fail('train.seq_len', t.seq_len, f'at most model.max_seq_len={m.max_seq_len}')

  dp, pp, tp = resolve_mesh(cfg.mesh.dp, cfg.mesh.pp, cfg.mesh.tp, n_devices)
  for key in ('n_heads', 'n_kv_heads', 'd_ff'):
    if m[key] % tp:
      _fail(f'model.{key}', m[key], f'must be divisible by mesh.tp={tp}')
  vocab_padded = padded_vocab(m)
  if vocab_padded % tp:
    _fail(
      'model.vocab_size',
      m.vocab_size,
      f'padded to {vocab_padded} (model.vocab_multiple='
      f'{m.vocab_multiple}), which mesh.tp={tp} does not divide; pick a vocab_multiple divisible by tp',
    )
  v = p_.repeats
  if m.n_layers % (pp * v):
    _fail(
      'model.n_layers', m.n_layers, f'must be divisible by mesh.pp*pipeline.repeats = {pp}*{v} = {pp * v}'
    )
  if v > 1 and p_.microbatches < pp:
    _fail(
      'pipeline.microbatches',
      p_.microbatches,
      f'the circular schedule (repeats={v}) needs microbatches >= mesh.pp={pp}',
    )
  per = dp * p_.microbatches * t.grad_accum
  if t.global_batch_size % per:
    _fail(
      'train.global_batch_size',
      t.global_batch_size,
      f'must be divisible by mesh.dp*'
      f'pipeline.microbatches*train.grad_accum = {dp}*{p_.microbatches}*{t.grad_accum} = {per} '
      f'(each micro-batch is split over dp)',
    )
  return RunPlan(
    sequence_parallel=_sequence_parallel(t.sequence_parallel, t.global_batch_size // per * t.seq_len, tp),
    dp=dp,
    pp=pp,
    tp=tp,
    microbatches=p_.microbatches,
    repeats=v,
    grad_accum=t.grad_accum,
    global_batch=t.global_batch_size,
    seq_len=t.seq_len,
    vocab_padded=vocab_padded,
    nan_steps=nan_steps,
    skip_bubbles=_skip_bubbles(p_.skip_bubbles),
  )


def _switch(key: str, value: Any) -> str:
  """A true | false | auto setting, lower-cased; anything else fails naming the key."""
  value = str(value).lower()
  if value not in SWITCH:
    _fail(key, value, f'one of {", ".join(SWITCH)}')
  return value


def _skip_bubbles(value: Any) -> bool | None:
  value = _switch('pipeline.skip_bubbles', value)
  return None if value == 'auto' else value == 'true'


def _sequence_parallel(value: Any, rows: int, tp: int) -> bool:
  """train.sequence_parallel resolved: the rows a layer sees (a micro-batch's rows on one dp shard
  times seq_len) are split over tp, so tp must divide them; 'auto' is on when it does."""
  value = _switch('train.sequence_parallel', value)
  if value == 'false' or tp == 1:
    return False
  if rows % tp:
    if value == 'auto':
      return False
    _fail(
      'train.sequence_parallel',
      value,
      f'the rows of a layer (micro-batch rows per dp shard * train.seq_len = {rows}) must be '
      f'divisible by mesh.tp={tp}; use a micro-batch or seq_len that tp divides, or false',
    )
  return True


def padded_vocab(model_cfg: ml_collections.ConfigDict) -> int:
  """The stored vocabulary: model.vocab_size rounded up to a multiple of model.vocab_multiple."""
  return -(-model_cfg.vocab_size // model_cfg.vocab_multiple) * model_cfg.vocab_multiple
