"""Every config key jax3d understands, declared once: a field of its section's frozen dataclass with
its type, its default, its valid range and what it means, on one line each:

    lr: float = key(3e-3, NON_NEGATIVE)  # peak learning rate (AdamW)

The comment on a key's line (and the comment lines directly above it) is its documentation:
docs/configuration.md is generated from them (scripts/config_docs.py), with each range's words.
The ranges are the vocabulary of jax3d/config/ranges.py; every value is checked against its range
and its type before anything compiles (`validate.check_ranges`). Settings that depend on each
other are checked in rules.py. A section's name is its class's, lower-cased (`Train` -> `train`).

`Config` holds the sections: the typed, frozen object the code reads (`cfg.train.lr`);
jax3d/config/forms.py makes the ConfigDict that config files and `--config.train.lr=...` edit
from it, and converts that back once its keys are checked. Tri-states are `Switch` values and
enumerations `Literal` types (jax3d/config/values.py).

To add a key: one line in its section, a range and a comment; then `python scripts/config_docs.py`.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from jax3d.config.ranges import (
  ANY,
  FRACTION,
  NON_NEGATIVE,
  POSITIVE,
  SEED,
  Range,
  above,
  at_least,
  between,
  either,
  existing,
  one_of,
  text,
)
from jax3d.config.values import (
  DATA_PATHS,
  HF_MODEL_TYPES,
  HF_PREFIX,
  STEP_LIST,
  SWITCHES,
  TARGET_LIST,
  Attention,
  BaseDtype,
  CpStrategy,
  Dtype,
  Gather,
  GradReduceDtype,
  MatmulDtype,
  Packing,
  RematPolicy,
  RopeScaling,
  Schedule,
  Switch,
  choice,
)

SHARE = between(0, 1, low_open=True, high_open=True)  # data.eval_fraction
AXIS = either(-1, POSITIVE, 'all devices left over')  # mesh.dp, pp, tp; -1 on at most one


def key(default: Any, valid: Range = ANY) -> Any:
  """A key's field: its default and its valid range (read back by `ranges()`)."""
  return dataclasses.field(default=default, metadata={'range': valid})


# The key names below are a public contract (tests, scripts and users rely on them): rename nothing.
@dataclasses.dataclass(frozen=True)
class Mesh:
  """`mesh.*`."""

  dp: int = key(-1, AXIS)  # data parallel; -1 = all devices left over by the other axes
  pp: int = key(1, AXIS)  # pipeline stages
  tp: int = key(1, AXIS)  # tensor (Megatron) parallel, kept inside a host
  allow_tp_across_hosts: bool = key(False, ANY)  # refuse a tp group that spans hosts unless forced
  # context parallel: devices sharing each row's tokens (a 4th mesh axis 'cp' when > 1)
  cp: int = key(1, POSITIVE)
  # expert parallel: devices splitting a mixture's experts (a 4th mesh axis 'ep' when > 1), data
  # parallel outside the experts; divides moe.num_experts
  ep: int = key(1, POSITIVE)


@dataclasses.dataclass(frozen=True)
class Moe:
  """`moe.*` (jax3d/model/moe.py)."""

  # routed experts per layer; 0 = a dense SwiGLU MLP (no mixture of experts)
  num_experts: int = key(0, at_least(0, '0 = dense'))
  top_k: int = key(2, POSITIVE)  # experts each token is sent to; at most num_experts
  # renormalise the top-k routing weights to sum to 1 (Mixtral: true; the HF config's norm_topk_prob)
  norm_topk_prob: bool = key(True, ANY)
  d_expert: int = key(0, at_least(0, '0 = model.d_ff'))  # one expert's SwiGLU hidden size; 0 = model.d_ff
  # hidden size of a shared expert every token also goes through (0 = none)
  d_shared: int = key(0, at_least(0, '0 = no shared expert'))
  # slots per expert = ceil(capacity_factor * tokens * top_k / num_experts) per sequence; tokens over it dropped
  capacity_factor: float = key(1.25, above(0))
  aux_loss_coef: float = key(0.01, NON_NEGATIVE)  # load-balancing loss coefficient (Switch/Mixtral form)
  z_loss_coef: float = key(0.0, NON_NEGATIVE)  # router z-loss coefficient (ST-MoE: mean logsumexp^2)


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """`pipeline.*`."""

  microbatches: int = key(1, POSITIVE)  # m: micro-batches per step (per grad_accum chunk)
  repeats: int = key(1, POSITIVE)  # v: layer chunks per stage; > 1 = the circular schedule
  # gpipe (circular when repeats > 1; 'circular' is the same) | 1f1b: one forward and one backward
  # per tick, the loss in the loop, activation memory bounded by the stages (interleaved with repeats > 1)
  schedule: Schedule = key('gpipe', choice(Schedule))
  # true | false | auto: a stage skips the work of its bubble iterations (a lax.cond); auto = on
  # CPU devices with jax >= 0.12, where fake devices share the cores (jax3d/parallel/pipeline/stages.py)
  skip_bubbles: Switch = key(Switch.AUTO, SWITCHES)


@dataclasses.dataclass(frozen=True)
class Model:
  """`model.*`."""

  n_layers: int = key(4, POSITIVE)  # decoder layers; divisible by mesh.pp * pipeline.repeats
  d_model: int = key(256, POSITIVE)  # hidden size; divisible by n_heads, head size even (rotary)
  n_heads: int = key(4, POSITIVE)  # query heads; divisible by mesh.tp
  # key/value heads (grouped-query attention); divides n_heads, divisible by mesh.tp
  n_kv_heads: int = key(4, POSITIVE)
  d_ff: int = key(1024, POSITIVE)  # SwiGLU hidden size; divisible by mesh.tp
  vocab_size: int = key(256, POSITIVE)  # real vocabulary (256 for bytes); at least the data's
  # the vocabulary is padded to a multiple of this (layout-independent)
  vocab_multiple: int = key(128, POSITIVE)
  max_seq_len: int = key(2048, POSITIVE)  # longest train.seq_len allowed
  rope_theta: float = key(10000.0, above(0))  # rotary embedding base
  norm_eps: float = key(1e-5, between(0, 1, low_open=True))  # RMSNorm epsilon
  # size of one attention head; 0 = d_model / n_heads (Qwen3 sets its own)
  head_dim: int = key(0, at_least(0, '0 = d_model / n_heads'))
  qkv_bias: bool = key(False, ANY)  # biases on the query, key and value projections (Qwen2/2.5)
  qk_norm: bool = key(False, ANY)  # per-head RMSNorm of queries and keys before the rotation (Qwen3)
  tie_embeddings: bool = key(False, ANY)  # one array is the input embedding and the output head
  # none | linear | llama3 (Llama 3.1+): rotary frequencies scaled
  rope_scaling: RopeScaling = key('none', choice(RopeScaling))
  rope_factor: float = key(1.0, at_least(1))  # linear and llama3: the context extension factor
  rope_low_freq_factor: float = key(
    1.0, above(0)
  )  # llama3: wavelengths above original/low are divided by factor
  rope_high_freq_factor: float = key(4.0, above(0))  # llama3: wavelengths below original/high are kept
  rope_original_max_seq_len: int = key(8192, POSITIVE)  # llama3: the context the model was first trained on
  # the Hugging Face architecture an export writes: '' = the one the features need (qwen3 with
  # qk_norm, qwen2 with qkv_bias, else llama); an import sets the one it read
  hf_model_type: str = key('', one_of(*HF_MODEL_TYPES))


@dataclasses.dataclass(frozen=True)
class Train:
  """`train.*`."""

  steps: int = key(1000, NON_NEGATIVE)  # optimizer steps of the whole run (the schedule decays over them)
  # sequences per optimizer step (all devices, all accumulation chunks)
  global_batch_size: int = key(32, POSITIVE)
  seq_len: int = key(128, POSITIVE)  # tokens per sequence
  seed: int = key(0, SEED)  # initialisation and data order; the batch of step i depends only on (seed, i)
  lr: float = key(3e-3, NON_NEGATIVE)  # peak learning rate (AdamW)
  min_lr_ratio: float = key(0.1, FRACTION)  # cosine decays to lr * min_lr_ratio
  warmup_steps: int = key(50, NON_NEGATIVE)  # linear warmup from 0, then cosine decay
  weight_decay: float = key(0.1, NON_NEGATIVE)  # AdamW decay of matrices (not norm scales)
  b1: float = key(0.9, between(0, 1, high_open=True))  # Adam beta1
  b2: float = key(0.95, between(0, 1, high_open=True))  # Adam beta2
  grad_clip: float = key(1.0, at_least(0, '0 disables'))  # global-norm clipping; 0 disables
  # none | dots | attn | full | stage  (see jax3d/parallel/remat.py)
  remat: RematPolicy = key('none', choice(RematPolicy))
  compute_dtype: Dtype = key('float32', choice(Dtype))  # float32 | bfloat16
  param_dtype: Dtype = key(
    'float32', choice(Dtype)
  )  # float32 | bfloat16 (master weights and optimizer state)
  # '' = compute_dtype | fp8: the decoder's projections as FP8 GEMMs (E4M3 forward, E5M2 gradients,
  # per-tensor current scaling; embedding and head in compute_dtype); on GPUs of compute capability
  # 8.9+ (H100, H200), emulated on CPU
  matmul_dtype: MatmulDtype = key('', choice(MatmulDtype))
  # the head and cross-entropy in this many pieces of the sequence (a scan, each piece's logits
  # recomputed in the backward): fp32 logits for 1/loss_chunks of the tokens at a time; divides seq_len
  loss_chunks: int = key(1, POSITIVE)
  grad_accum: int = key(1, POSITIVE)  # sequential chunks of the global batch per optimizer step
  max_bad_steps: int = key(5, POSITIVE)  # consecutive non-finite steps before the run stops
  inject_nan_at: str = key('', STEP_LIST)  # fault drill: comma-separated steps whose loss is made NaN
  shard_optimizer: bool = key(False, ANY)  # ZeRO-1: shard Adam moments over dp
  # ZeRO-3: parameters, gradients and Adam moments sharded over dp, gathered where used
  shard_params: bool = key(False, ANY)
  # auto | layer | step: per layer in the loop, or once per step
  shard_params_gather: Gather = key('auto', choice(Gather))
  # float32 | bfloat16 | int8 for the dp gradient reduction (ZeRO-3 per layer: float32 | bfloat16)
  grad_reduce_dtype: GradReduceDtype = key('float32', choice(GradReduceDtype))
  # auto: on NVIDIA GPUs in bf16/fp16 (head size a multiple of 8, <= 256) fused = cuDNN for rows of one document, Pallas for rows of documents; else blockwise | xla (dense mask, the reference) | cudnn (documents as a [b,1,t,t] bias) | pallas (Pallas Triton flash attention with segment ids; GPUs only) | blockwise (memory linear in seq)
  attention: Attention = key('auto', choice(Attention))
  # Megatron-SP with tp > 1: true | false | auto (on when rows divide)
  sequence_parallel: Switch = key(Switch.FALSE, SWITCHES)
  # attention over mesh.cp > 1: allgather (K/V all-gathered over cp) | ring (K/V passed round the cp ring, ppermute)
  cp_strategy: CpStrategy = key('allgather', choice(CpStrategy))


@dataclasses.dataclass(frozen=True)
class Data:
  """`data.*`."""

  path: str = key('', existing(DATA_PATHS))  # '' = the Python standard library's own source, as bytes
  # held-out share (by file where the corpus has files)
  eval_fraction: float = key(0.05, SHARE)
  prefetch: int = key(2, NON_NEGATIVE)  # batches prepared ahead on a background thread
  # bytes | a tokenizer.json | a SentencePiece .model | a folder with one
  tokenizer: str = key('bytes', text('bytes, or a path'))
  # auto | concat | pack: rows of documents (docs/data.md); auto = pack for chat data, else concat
  packing: Packing = key('auto', choice(Packing))
  # weighted sources instead of data.path: NAME=WEIGHT:PATH,... (docs/data.md, mixtures); '' = none
  mixture: str = key('', ANY)
  # weights from later steps on: STEP:NAME=WEIGHT,...;STEP:... ('' = data.mixture's weights throughout)
  mixture_stages: str = key('', ANY)


@dataclasses.dataclass(frozen=True)
class Log:
  """`log.*`."""

  every: int = key(10, POSITIVE)  # steps between metric records and console lines
  tensorboard: bool = key(False, ANY)  # also write TensorBoard event files to WORKDIR/tensorboard
  progress: bool = key(True, ANY)  # live progress line on a terminal
  leak_window: int = key(20, at_least(3))  # logged steps the memory-leak detector fits its slope over
  leak_mb_per_step: float = key(
    1.0, at_least(0)
  )  # sustained growth above this (MB per step, any device) warns


@dataclasses.dataclass(frozen=True)
class Eval:
  """`eval.*`."""

  # steps between held-out evaluations (0 = only at the end)
  every: int = key(100, at_least(0, '0 = only at the end'))
  batches: int = key(8, POSITIVE)  # held-out batches per evaluation (fixed, the same for every layout)
  # lm-evaluation-harness tasks run during training: a comma list of names ('' = none; docs/evaluation.md)
  tasks: str = key('', ANY)
  tasks_every: int = key(0, at_least(0, '0 = only at the end'))  # steps between task evaluations
  tasks_limit: int = key(0, at_least(0, '0 = all'))  # documents per task (0 = all)
  # a folder of task YAML files (tasks over local data files), searched before lm-eval's own
  tasks_include_path: str = key('', existing('folder of task YAML files'))
  # few-shot examples per prompt; -1 = the task's own
  tasks_num_fewshot: int = key(-1, either(-1, NON_NEGATIVE, "the task's own"))


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """`checkpoint.*`."""

  # steps between checkpoints (also at the end and on SIGTERM)
  every: int = key(200, at_least(0, '0 = only at the end'))
  keep: int = key(3, POSITIVE)  # newest checkpoints kept
  async_save: bool = key(True, ANY)  # write in the background while training continues
  # warm start: parameters of another run's WORKDIR, or hf:PATH (a Hugging Face model folder)
  init_from: str = key('', existing("run's WORKDIR, or hf:FOLDER", prefix=HF_PREFIX))


@dataclasses.dataclass(frozen=True)
class Profile:
  """`profile.*`."""

  start: int = key(-1, either(-1, NON_NEGATIVE, 'no profile'))  # first profiled step; -1 = no profile
  steps: int = key(3, POSITIVE)  # steps traced


@dataclasses.dataclass(frozen=True)
class Hardware:
  """`hardware.*`."""

  # per device; 0 = look it up from the device kind (unknown on CPU)
  peak_tflops: float = key(0.0, at_least(0, '0 = look it up'))
  # GB per device the compiled step must fit (any backend); 0 = the device's limit
  memory_gb: float = key(0.0, at_least(0, "0 = the device's own limit"))


@dataclasses.dataclass(frozen=True)
class Lora:
  """`lora.*`."""

  # LoRA adapters' rank r: the base frozen, only the adapters trained; 0 = off (full fine-tune)
  rank: int = key(0, at_least(0, '0 = no LoRA: a full fine-tune'))
  alpha: float = key(16.0, above(0))  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
  # the projections adapted: a comma list of q,k,v,o,gate,up,down
  targets: str = key('q,k,v,o,gate,up,down', TARGET_LIST)
  # dropout on the adapters' input in training steps (PEFT's lora_dropout); the same masks on every layout
  dropout: float = key(0.0, between(0, 1, high_open=True))
  # the frozen base's storage: '' = train.param_dtype | float32 | bfloat16 | int8 (the projection
  # kernels int8 with a scale per output channel, the rest bfloat16: QLoRA-style)
  base_dtype: BaseDtype = key('', choice(BaseDtype))
  # a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) to start from
  init_from: str = key('', existing('PEFT adapter folder'))


@dataclasses.dataclass(frozen=True)
class Sample:
  """`sample.*`."""

  prompt: str = key('def ', ANY)  # prompt of the text sample at the end of a run
  tokens: int = key(200, NON_NEGATIVE)  # tokens generated
  temperature: float = key(0.8, at_least(0, '0 = greedy'))  # 0 = greedy
  top_k: int = key(40, at_least(0, '0 = all'))  # sample among the k likeliest tokens (0 = all)


@dataclasses.dataclass(frozen=True)
class Config:
  """A whole config, typed and frozen: what the code reads (`typed(cfg)` makes it from a checked
  ConfigDict). `to_dict()` is the ConfigDict's own dict (checkpoints and metrics record it)."""

  mesh: Mesh = dataclasses.field(default_factory=Mesh)
  pipeline: Pipeline = dataclasses.field(default_factory=Pipeline)
  model: Model = dataclasses.field(default_factory=Model)
  moe: Moe = dataclasses.field(default_factory=Moe)
  train: Train = dataclasses.field(default_factory=Train)
  data: Data = dataclasses.field(default_factory=Data)
  log: Log = dataclasses.field(default_factory=Log)
  eval: Eval = dataclasses.field(default_factory=Eval)
  checkpoint: Checkpoint = dataclasses.field(default_factory=Checkpoint)
  profile: Profile = dataclasses.field(default_factory=Profile)
  hardware: Hardware = dataclasses.field(default_factory=Hardware)
  lora: Lora = dataclasses.field(default_factory=Lora)
  sample: Sample = dataclasses.field(default_factory=Sample)

  def to_dict(self) -> dict[str, dict[str, Any]]:
    return {
      name: {f.name: _plain(getattr(section, f.name)) for f in dataclasses.fields(section)}
      for name, section in ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
    }


def _plain(value: Any) -> Any:
  """A key's value as the ConfigDict holds it (a Switch as its word)."""
  return value.value if isinstance(value, enum.Enum) else value
