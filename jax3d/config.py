"""Configs: the defaults of every key, loading `configs/*.py`, and validation into a frozen run plan.

Every check here runs before jax traces or compiles anything, and raises `ConfigError` with one
line naming the setting, its value and what would be valid. The command-line tools turn a
`ConfigError` into exit status 2.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from collections.abc import Mapping
from typing import Any, NoReturn

import ml_collections

DTYPES = ('float32', 'bfloat16')
REMAT_POLICIES = ('none', 'dots', 'attn', 'full', 'stage')
SCHEDULES = ('gpipe', 'circular')
GRAD_REDUCE_DTYPES = ('float32', 'bfloat16', 'int8')
ATTENTION_IMPLS = ('auto', 'xla', 'cudnn')
SWITCH = ('true', 'false', 'auto')  # the values of train.sequence_parallel, pipeline.skip_bubbles


class ConfigError(ValueError):
  """A setting that cannot work. The message is one line: setting, value, what would be valid."""


# The key names below are a public contract (tests, scripts and users rely on them): rename nothing.
def base_config() -> ml_collections.ConfigDict:
  """Every key jax3d understands, with its default; `configs/*.py` start from it."""
  c = ml_collections.ConfigDict()

  c.mesh = ml_collections.ConfigDict()
  c.mesh.dp = -1  # data parallel; -1 = all devices left over by the other axes
  c.mesh.pp = 1  # pipeline stages
  c.mesh.tp = 1  # tensor (Megatron) parallel, kept inside a host
  c.mesh.allow_tp_across_hosts = False  # refuse a tp group that spans hosts unless forced

  c.pipeline = ml_collections.ConfigDict()
  c.pipeline.microbatches = 1  # m: micro-batches per step (per grad_accum chunk)
  c.pipeline.repeats = 1  # v: layer chunks per stage; > 1 = the circular schedule
  c.pipeline.schedule = 'gpipe'  # 'gpipe' or 'circular' (repeats > 1 is circular)
  # true | false | auto: a stage skips the work of its bubble iterations (a lax.cond); auto = on
  # CPU devices with jax >= 0.12, where fake devices share the cores (jax3d/parallel/pipeline.py)
  c.pipeline.skip_bubbles = 'auto'

  c.model = ml_collections.ConfigDict()
  c.model.n_layers = 4  # decoder layers; divisible by mesh.pp * pipeline.repeats
  c.model.d_model = 256  # hidden size; divisible by n_heads, head size even (rotary)
  c.model.n_heads = 4  # query heads; divisible by mesh.tp
  c.model.n_kv_heads = 4  # key/value heads (grouped-query attention); divides n_heads, divisible by mesh.tp
  c.model.d_ff = 1024  # SwiGLU hidden size; divisible by mesh.tp
  c.model.vocab_size = 256  # real vocabulary (256 for bytes); at least the data's
  c.model.vocab_multiple = 128  # the vocabulary is padded to a multiple of this (layout-independent)
  c.model.max_seq_len = 2048  # longest train.seq_len allowed
  c.model.rope_theta = 10000.0  # rotary embedding base
  c.model.norm_eps = 1e-5  # RMSNorm epsilon
  c.train = ml_collections.ConfigDict()
  c.train.steps = 1000  # optimizer steps of the whole run (the schedule decays over them)
  c.train.global_batch_size = 32  # sequences per optimizer step (all devices, all accumulation chunks)
  c.train.seq_len = 128  # tokens per sequence
  c.train.seed = 0  # initialisation and data order; the batch of step i depends only on (seed, i)
  c.train.lr = 3e-3  # peak learning rate (AdamW)
  c.train.min_lr_ratio = 0.1  # cosine decays to lr * min_lr_ratio
  c.train.warmup_steps = 50  # linear warmup from 0, then cosine decay
  c.train.weight_decay = 0.1  # AdamW decay of matrices (not norm scales)
  c.train.b1 = 0.9  # Adam beta1
  c.train.b2 = 0.95  # Adam beta2
  c.train.grad_clip = 1.0  # global-norm clipping; 0 disables
  c.train.remat = 'none'  # none | full | dots | attn  (see jax3d/model/remat.py)
  c.train.compute_dtype = 'float32'  # float32 | bfloat16
  c.train.param_dtype = 'float32'  # float32 | bfloat16 (master weights and optimizer state)
  c.train.grad_accum = 1  # sequential chunks of the global batch per optimizer step
  c.train.max_bad_steps = 5  # consecutive non-finite steps before the run stops
  c.train.inject_nan_at = ''  # fault drill: comma-separated steps whose loss is made NaN
  c.train.shard_optimizer = False  # ZeRO-1: shard Adam moments over dp
  c.train.grad_reduce_dtype = 'float32'  # float32 | bfloat16 | int8 for the dp gradient reduction
  c.train.attention = 'auto'  # auto | xla | cudnn  (jax.nn.dot_product_attention implementation)
  c.train.sequence_parallel = 'false'  # Megatron-SP with tp > 1: true | false | auto (on when rows divide)

  c.data = ml_collections.ConfigDict()
  c.data.path = ''  # '' = the Python standard library's own source, as bytes
  c.data.eval_fraction = 0.05  # held-out share (by file where the corpus has files)
  c.data.prefetch = 2  # batches prepared ahead on a background thread
  c.data.tokenizer = 'bytes'  # bytes | a tokenizer.json | a SentencePiece .model | a folder with one

  c.log = ml_collections.ConfigDict()
  c.log.every = 10  # steps between metric records and console lines
  c.log.tensorboard = False  # also write TensorBoard event files to WORKDIR/tensorboard
  c.log.progress = True  # live progress line on a terminal
  c.log.leak_window = 20  # logged steps the memory-leak detector fits its slope over
  c.log.leak_mb_per_step = 1.0  # sustained growth above this (MB per step, any device) warns

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 100  # steps between held-out evaluations (0 = only at the end)
  c.eval.batches = 8  # held-out batches per evaluation (fixed, the same for every layout)
  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 200  # steps between checkpoints (also at the end and on SIGTERM)
  c.checkpoint.keep = 3  # newest checkpoints kept
  c.checkpoint.async_save = True  # write in the background while training continues
  c.checkpoint.init_from = (
    ''  # warm start: parameters of another run's WORKDIR, or hf:PATH (Llama safetensors)
  )

  c.profile = ml_collections.ConfigDict()
  c.profile.start = -1  # first profiled step; -1 = no profile
  c.profile.steps = 3  # steps traced
  c.hardware = ml_collections.ConfigDict()
  c.hardware.peak_tflops = 0.0  # per device; 0 = look it up from the device kind (unknown on CPU)
  c.hardware.memory_gb = 0.0  # GB per device the compiled step must fit (any backend); 0 = the device's limit

  c.sample = ml_collections.ConfigDict()
  c.sample.prompt = 'def '  # prompt of the text sample at the end of a run
  c.sample.tokens = 200  # tokens generated
  c.sample.temperature = 0.8  # 0 = greedy
  c.sample.top_k = 40  # sample among the k likeliest tokens (0 = all)
  return c


def configs_dir() -> str:
  """The folder of the shipped configs, `jax3d/configs/` (package data, so a non-editable install
  has them too; the repository's top-level `configs` is a link to it)."""
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs')


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
  spec = importlib.util.spec_from_file_location('jax3d_user_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config()
  cfg.lock()
  for key, value in (overrides or {}).items():
    set_key(cfg, key, value)
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


# --------------------------------------------------------------------------------------------
# The run plan: every derived number, validated.
# --------------------------------------------------------------------------------------------
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
