"""What the settings may be against each other: the tables `validate` runs in order (each key's own
range is declared beside its default, in keys.py).

MODEL_CHECKS relate model and train keys to each other; LAYOUT_CHECKS relate them
to the mesh (dp, pp, tp resolved from the device count). A check returns (key, value, what is
valid) when it fails, None when it passes; the error names them word for word.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax3d.config.keys import Config, Model
from jax3d.config.values import HF_MODEL_TYPES, lora_targets

# ---------------------------------------------------------------------------------------------
# Settings against each other: each check returns (key, value, what is valid) when it fails.
# ---------------------------------------------------------------------------------------------
Failure = tuple[str, Any, str] | None


def _heads_divide_d_model(cfg: Config) -> Failure:
  m = cfg.model
  if not m.head_dim and m.d_model % m.n_heads:
    return 'model.d_model', m.d_model, f'a multiple of model.n_heads={m.n_heads} (or set model.head_dim)'
  return None


def _head_size_even(cfg: Config) -> Failure:
  m = cfg.model
  if m.head_dim % 2:
    return 'model.head_dim', m.head_dim, 'an even number (rotary embeddings rotate pairs)'
  if (m.d_model // m.n_heads) % 2 and not m.head_dim:
    return (
      'model.d_model',
      m.d_model,
      f'd_model/n_heads must be even for rotary embeddings (it is {m.d_model // m.n_heads})',
    )
  return None


def _llama3_frequencies(cfg: Config) -> Failure:
  m = cfg.model
  if m.rope_scaling == 'llama3' and not m.rope_high_freq_factor > m.rope_low_freq_factor > 0:
    return (
      'model.rope_high_freq_factor',
      m.rope_high_freq_factor,
      f'greater than model.rope_low_freq_factor={m.rope_low_freq_factor} > 0 (llama3 rope scaling)',
    )
  return None


def _hf_model_type_holds_features(cfg: Config) -> Failure:
  m, moe = cfg.model, cfg.moe
  need = {'qwen2': (True, False, False), 'qwen3': (False, True, False), 'mixtral': (False, False, True)}
  want = (need | {'qwen3_moe': (False, True, True)}).get(m.hf_model_type, (False, False, False))
  have = (m.qkv_bias, m.qk_norm, moe.num_experts > 0)
  moe_only = moe.num_experts > 0 and (
    moe.d_shared or (m.hf_model_type == 'mixtral' and not moe.norm_topk_prob)
  )
  if m.hf_model_type and (have != want or moe_only):
    return (
      'model.hf_model_type',
      m.hf_model_type,
      f'an architecture that holds qkv_bias={m.qkv_bias}, qk_norm={m.qk_norm}, '
      f'moe.num_experts={moe.num_experts} ({"; ".join(f"{k or chr(39) * 2}: {v}" for k, v in HF_MODEL_TYPES.items())})',
    )
  if m.qkv_bias and m.qk_norm:
    return 'model.qk_norm', m.qk_norm, 'false with model.qkv_bias=true (no exported architecture has both)'
  return None


def _kv_heads_divide_heads(cfg: Config) -> Failure:
  m = cfg.model
  if m.n_heads % m.n_kv_heads:
    return 'model.n_kv_heads', m.n_kv_heads, f'a divisor of model.n_heads={m.n_heads}'
  return None


def _seq_len_fits(cfg: Config) -> Failure:
  if cfg.train.seq_len > cfg.model.max_seq_len:
    return 'train.seq_len', cfg.train.seq_len, f'at most model.max_seq_len={cfg.model.max_seq_len}'
  return None


def _loss_chunks_divide_seq(cfg: Config) -> Failure:
  c, t = cfg.train.loss_chunks, cfg.train.seq_len
  if t % c:
    return (
      'train.loss_chunks',
      c,
      f'a divisor of train.seq_len={t}: the head and loss run on pieces of the sequence, '
      f'seq_len/loss_chunks positions of every row each (valid: '
      f'{", ".join(str(d) for d in range(1, t + 1) if t % d == 0)})',
    )
  return None


def _layer_gather_on_compiler_path(cfg: Config) -> Failure:
  t = cfg.train
  if t.shard_params and t.shard_params_gather == 'layer':
    # a bf16 wire is reduced per layer by the gather's VJP (data_parallel.layer_reduces_bf16)
    on_compiler_path = {'grad_reduce_dtype': ('float32', 'bfloat16'), 'param_dtype': ('float32',)}
    why = [f'train.{k}={getattr(t, k)!r}' for k, ok in on_compiler_path.items() if getattr(t, k) not in ok]
    if why:
      return (
        'train.shard_params_gather',
        t.shard_params_gather,
        f"'step' or 'auto' with {' and '.join(why)}: that reduction sums each rank's whole "
        'gradient once per step, so the parameters are gathered once per step',
      )
  return None


def _lora_settings_need_rank(cfg: Config) -> Failure:
  lo = cfg.lora
  if lo.rank == 0 and lo.init_from:
    return 'lora.rank', lo.rank, f"the adapters' rank (> 0) with lora.init_from={lo.init_from!r}"
  if lo.rank == 0 and lo.base_dtype:
    return 'lora.rank', lo.rank, f"the adapters' rank (> 0) with lora.base_dtype={lo.base_dtype!r}"
  if lo.base_dtype == 'int8' and cfg.pipeline.schedule == '1f1b':  # its loop differentiates every weight
    return 'lora.base_dtype', lo.base_dtype, "float32 or bfloat16 with pipeline.schedule='1f1b'"
  if lo.init_from and not cfg.checkpoint.init_from.startswith('hf:'):
    return (
      'checkpoint.init_from',
      cfg.checkpoint.init_from,
      f'hf:PATH, the base model the adapter of lora.init_from={lo.init_from!r} was trained on',
    )
  return None


def _fp8_settings(cfg: Config) -> Failure:
  t, lo = cfg.train, cfg.lora
  if t.matmul_dtype == 'fp8' and lo.rank and lo.base_dtype == 'int8':  # int8 -> bf16 -> fp8: two roundings
    return 'train.matmul_dtype', t.matmul_dtype, "'' (the compute dtype) with lora.base_dtype='int8'"
  if t.matmul_dtype == 'fp8' and t.sequence_parallel == 'true':  # SP's projections: no FP8 path built
    return 'train.sequence_parallel', t.sequence_parallel.value, "false or auto with train.matmul_dtype='fp8'"
  if t.matmul_dtype == 'fp8' and cfg.moe.num_experts:  # the experts' grouped matmuls: no FP8 path built
    return 'train.matmul_dtype', t.matmul_dtype, "'' (the compute dtype) with moe.num_experts > 0"
  return None


def lora_sides(model_cfg: Model) -> dict[str, tuple[int, int]]:
  """Each LoRA target's projection as (input features, output features)."""
  m = model_cfg
  q, kv = (
    m.n_heads * (m.head_dim or m.d_model // m.n_heads),
    m.n_kv_heads * (m.head_dim or m.d_model // m.n_heads),
  )
  io = {'q': (m.d_model, q), 'k': (m.d_model, kv), 'v': (m.d_model, kv), 'o': (q, m.d_model)}
  return io | {'gate': (m.d_model, m.d_ff), 'up': (m.d_model, m.d_ff), 'down': (m.d_ff, m.d_model)}


def _lora_rank_fits_layers(cfg: Config) -> Failure:
  """A rank past a projection's smaller side adds nothing an update of full rank lacks, and holds
  more parameters than the projection itself (a trainable share over 100%)."""
  sides = lora_sides(cfg.model)
  targets = [t for t in lora_targets(cfg.lora.targets) if t in sides]
  if cfg.lora.rank and targets:
    small = min(targets, key=lambda t: min(sides[t]))
    most = min(sides[small])
    if cfg.lora.rank > most:
      return (
        'lora.rank',
        cfg.lora.rank,
        f'at most {most}, the smaller side of the {small} projection ({sides[small][0]} x '
        f'{sides[small][1]}) of lora.targets={cfg.lora.targets!r}: a larger rank adapts nothing more',
      )
  return None


def _moe_settings(cfg: Config) -> Failure:
  """A mixture of experts (moe.num_experts > 0): k of the experts, room in the residual stream for
  the router statistics' row (jax3d/model/moe.py), and what it is not built with yet."""
  e, m = cfg.moe.num_experts, cfg.moe
  if not e:
    return None
  if m.top_k > e:
    return 'moe.top_k', m.top_k, f'at most moe.num_experts={e}'
  if cfg.model.d_model < e + 3:
    return (
      'moe.num_experts',
      e,
      f'at most model.d_model - 3 = {cfg.model.d_model - 3} (the router statistics ride in one row of the stream)',
    )
  not_yet = f'not supported yet with moe.num_experts={e} > 0'
  adapted = sorted(set(lora_targets(cfg.lora.targets)) & {'gate', 'up', 'down'}) if cfg.lora.rank else []
  unsupported = (
    (
      'train.sequence_parallel',
      cfg.train.sequence_parallel.value,
      cfg.train.sequence_parallel == 'true',
      f'false or auto (auto resolves off: sequence parallelism is {not_yet})',
    ),
    (
      'lora.targets',
      cfg.lora.targets,
      bool(adapted),
      f'attention projections only (q,k,v,o): {not_yet} on the experts',
    ),
  )
  for key, value, bad, valid in unsupported:
    if bad:
      return key, value, valid
  return None


MODEL_CHECKS: tuple[Callable[[Config], Failure], ...] = (
  _heads_divide_d_model,
  _head_size_even,
  _kv_heads_divide_heads,
  _seq_len_fits,
  _loss_chunks_divide_seq,
  _layer_gather_on_compiler_path,
  _llama3_frequencies,
  _hf_model_type_holds_features,
  _lora_settings_need_rank,
  _lora_rank_fits_layers,
  _moe_settings,
  _fp8_settings,
)


def _tp_divides_layers(cfg: Config, dp: int, pp: int, tp: int) -> Failure:
  for key in ('n_heads', 'n_kv_heads', 'd_ff'):
    if getattr(cfg.model, key) % tp:
      return f'model.{key}', getattr(cfg.model, key), f'must be divisible by mesh.tp={tp}'
  for key in ('d_expert', 'd_shared'):
    if cfg.moe.num_experts and getattr(cfg.moe, key) % tp:
      return (
        f'moe.{key}',
        getattr(cfg.moe, key),
        f'must be divisible by mesh.tp={tp} (the experts split over tp)',
      )
  return None


def _tp_divides_vocab(cfg: Config, dp: int, pp: int, tp: int) -> Failure:
  m, vocab_padded = cfg.model, padded_vocab(cfg.model)
  if vocab_padded % tp:
    return (
      'model.vocab_size',
      m.vocab_size,
      f'padded to {vocab_padded} (model.vocab_multiple='
      f'{m.vocab_multiple}), which mesh.tp={tp} does not divide; pick a vocab_multiple divisible by tp',
    )
  return None


def _stages_divide_layers(cfg: Config, dp: int, pp: int, tp: int) -> Failure:
  n, v = cfg.model.n_layers, cfg.pipeline.repeats
  if n % (pp * v):
    return 'model.n_layers', n, f'must be divisible by mesh.pp*pipeline.repeats = {pp}*{v} = {pp * v}'
  return None


def _circular_has_microbatches(cfg: Config, dp: int, pp: int, tp: int) -> Failure:
  m, v = cfg.pipeline.microbatches, cfg.pipeline.repeats
  if v > 1 and m < pp:
    return (
      'pipeline.microbatches',
      m,
      f'the circular schedule (repeats={v}) needs microbatches >= mesh.pp={pp}',
    )
  return None


def _batch_divides(cfg: Config, dp: int, pp: int, tp: int) -> Failure:
  t, m = cfg.train, cfg.pipeline.microbatches
  per = dp * m * t.grad_accum
  if t.global_batch_size % per:
    return (
      'train.global_batch_size',
      t.global_batch_size,
      f'must be divisible by mesh.dp*'
      f'pipeline.microbatches*train.grad_accum = {dp}*{m}*{t.grad_accum} = {per} '
      f'(each micro-batch is split over dp)',
    )
  return None


def _interleaved_1f1b_groups(cfg: Config, dp: int, pp: int, tp: int) -> Failure:
  m, v = cfg.pipeline.microbatches, cfg.pipeline.repeats
  if cfg.pipeline.schedule == '1f1b' and v > 1 and pp > 1 and m % pp:
    return (
      'pipeline.microbatches',
      m,
      f'interleaved 1F1B (repeats={v}) runs the micro-batches in groups of mesh.pp={pp}: a multiple of {pp}',
    )
  return None


def _context_parallel(cfg: Config, dp: int, pp: int, tp: int) -> Failure:
  """mesh.cp > 1: the settings context parallelism is built and tested with (the rest refused)."""
  cp, t = cfg.mesh.cp, cfg.train
  if cp == 1:
    return None
  not_yet = f'not supported yet with mesh.cp={cp} > 1'
  unsupported = (
    (
      'train.attention',
      t.attention,
      t.attention in ('xla', 'cudnn', 'pallas'),
      f'{not_yet}; valid: auto, blockwise',
    ),
  )
  for key, value, bad, valid in unsupported:
    if bad:
      return key, value, valid
  if t.seq_len % (2 * cp):
    return (
      'train.seq_len',
      t.seq_len,
      f'must be divisible by 2*mesh.cp = {2 * cp} (each row splits into 2*cp chunks)',
    )
  return None


def _expert_parallel(cfg: Config, dp: int, pp: int, tp: int) -> Failure:
  """mesh.ep > 1: a mixture whose experts and micro-batch rows divide over ep."""
  ep, e, t = cfg.mesh.ep, cfg.moe.num_experts, cfg.train
  if ep == 1:
    return None
  if not e:
    return 'mesh.ep', ep, '1 without a mixture of experts (moe.num_experts=0: nothing to split)'
  if e % ep:
    return 'mesh.ep', ep, f'a divisor of moe.num_experts={e} (each ep rank holds num_experts/ep experts)'
  per = dp * cfg.pipeline.microbatches * t.grad_accum * ep
  if t.global_batch_size % per:
    return (
      'train.global_batch_size',
      t.global_batch_size,
      f'must be divisible by mesh.dp*pipeline.microbatches*train.grad_accum*mesh.ep = {per} '
      '(each micro-batch is split over dp, then over ep)',
    )
  return None


def _moe_1f1b_rows(cfg: Config, dp: int, pp: int, tp: int) -> Failure:
  """1F1B splits each micro-batch's head over pp by rows, else by positions: with a mixture of
  experts the positions hold the router statistics' row too, so the rows must split."""
  t, m = cfg.train, cfg.pipeline.microbatches
  rows = t.global_batch_size // max(1, dp * m * t.grad_accum)
  if cfg.moe.num_experts and cfg.pipeline.schedule == '1f1b' and pp > 1 and rows % pp:
    return (
      'train.global_batch_size',
      t.global_batch_size,
      f'a multiple of mesh.dp*pipeline.microbatches*train.grad_accum*mesh.pp = {dp * m * t.grad_accum * pp} '
      "(1F1B with a mixture of experts splits each micro-batch's rows over pp for the head)",
    )
  return None


LAYOUT_CHECKS: tuple[Callable[[Config, int, int, int], Failure], ...] = (
  _tp_divides_layers,
  _tp_divides_vocab,
  _stages_divide_layers,
  _circular_has_microbatches,
  _interleaved_1f1b_groups,
  _batch_divides,
  _context_parallel,
  _moe_1f1b_rows,
  _expert_parallel,
)


def padded_vocab(model_cfg: Config) -> int:
  """The stored vocabulary: model.vocab_size rounded up to a multiple of model.vocab_multiple."""
  return -(-model_cfg.vocab_size // model_cfg.vocab_multiple) * model_cfg.vocab_multiple
