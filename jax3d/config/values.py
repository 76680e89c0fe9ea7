"""The values of config keys that are not plain numbers or words: the tri-state `Switch`, the
enumerations (each written once, as a `Literal` type: the keys' types and ranges in keys.py and the
modules that implement them read it from here), and the parsers and ranges of the list-valued keys.
Imports nothing of jax."""

from __future__ import annotations

import enum
import typing
from typing import Any, Literal

from jax3d.config.ranges import Range, one_of


class Switch(enum.StrEnum):
  """A tri-state setting (train.sequence_parallel, pipeline.skip_bubbles): true, false or auto
  (decided by the run). Written in any case on the command line; a `str`, so it compares equal to
  its word."""

  TRUE = 'true'
  FALSE = 'false'
  AUTO = 'auto'

  @classmethod
  def parse(cls, value: Any) -> Switch:
    """'True', 'false', 'AUTO', a Python bool: the Switch (a value its range accepts)."""
    return cls(str(value).lower())

  def resolve(self, auto: bool) -> bool:
    """On or off: `auto` decides an AUTO."""
    return auto if self is Switch.AUTO else self is Switch.TRUE


# The enumerations, each once: the keys' types, their ranges and the implementing modules read them.
Schedule = Literal['gpipe', 'circular', '1f1b']  # jax3d/parallel/pipeline/timetable.py for 1f1b
RematPolicy = Literal['none', 'dots', 'attn', 'full', 'stage']  # jax3d/parallel/remat.py
Dtype = Literal['float32', 'bfloat16']
GradReduceDtype = Literal[Dtype, 'int8']  # the dp gradient reduction (jax3d/parallel/compression.py)
BaseDtype = Literal['', Dtype, 'int8']  # lora.base_dtype ('' = train.param_dtype; jax3d/model/quant.py)
MatmulDtype = Literal['', 'fp8']  # train.matmul_dtype ('' = train.compute_dtype; jax3d/model/fp8.py)
Gather = Literal['auto', 'layer', 'step']  # train.shard_params_gather (jax3d/parallel/zero3.py)
Attention = Literal['auto', 'xla', 'cudnn', 'pallas', 'blockwise']  # jax3d/model/attention.py
CpStrategy = Literal['allgather', 'ring']  # train.cp_strategy (jax3d/parallel/context.py)
Packing = Literal['auto', 'concat', 'pack']  # data.packing (jax3d/data/packing.py)
RopeScaling = Literal['none', 'linear', 'llama3']  # jax3d/model/rope.py
LoraTarget = Literal['q', 'k', 'v', 'o', 'gate', 'up', 'down']  # lora.targets (jax3d/model/lora.py)


def names(alias: Any) -> tuple[str, ...]:
  """The words of a Literal type, nested Literals flattened: names(GradReduceDtype) ->
  ('float32', 'bfloat16', 'int8')."""
  out: list[str] = []
  for arg in typing.get_args(alias):
    out += names(arg) if typing.get_origin(arg) is Literal else [arg]
  return tuple(out)


SWITCH = tuple(s.value for s in Switch)
SCHEDULES = names(Schedule)
REMAT_POLICIES = names(RematPolicy)
DTYPES = names(Dtype)
GRAD_REDUCE_DTYPES = names(GradReduceDtype)
ATTENTION_IMPLS = names(Attention)
LORA_TARGETS = names(LoraTarget)
PACKINGS = names(Packing)
ROPE_SCALINGS = names(RopeScaling)
# model.hf_model_type: the architectures export writes, and the features each can hold
HF_MODEL_TYPES = {
  '': 'the one the features need',
  'llama': 'no qkv_bias, no qk_norm',
  'mistral': 'no qkv_bias, no qk_norm',
  'qwen2': 'qkv_bias, no qk_norm',
  'qwen3': 'qk_norm, no qkv_bias',
  'mixtral': 'moe.num_experts > 0, no qkv_bias, no qk_norm, moe.norm_topk_prob, no moe.d_shared',
  'qwen3_moe': 'moe.num_experts > 0, qk_norm, no qkv_bias, no moe.d_shared',
}
HF_PREFIX = 'hf:'  # checkpoint.init_from=hf:FOLDER, a Hugging Face model folder
DATA_PATHS = (
  'text file, folder of text files, folder of token shards, uint16 .bin token file, '
  'or folder with train.bin and val.bin'
)


def choice(alias: Any) -> Range:
  """The range of an enumeration key: one of its Literal's words."""
  return one_of(*names(alias))


SWITCHES = one_of(*SWITCH, fold_case=True)


def lora_targets(value: Any) -> tuple[str, ...]:  # lora.targets: 'q, v' -> ('q', 'v')
  return tuple(x.strip() for x in str(value).split(',') if x.strip())


def _is_target_list(value: Any) -> bool:
  got = lora_targets(value)
  return bool(got) and set(got) <= set(LORA_TARGETS) and len(set(got)) == len(got)


TARGET_LIST = Range(_is_target_list, f'a comma list of distinct names from {",".join(LORA_TARGETS)}')


def step_list(value: Any) -> tuple[int, ...]:  # train.inject_nan_at: '3,4' -> (3, 4)
  return tuple(int(x) for x in str(value).split(',') if x.strip())


def _is_step_list(value: Any) -> bool:
  try:
    return all(s >= 0 for s in step_list(value))
  except ValueError:
    return False


STEP_LIST = Range(_is_step_list, 'comma-separated step numbers >= 0, e.g. "3,4"')
