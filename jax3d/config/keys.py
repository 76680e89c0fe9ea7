"""Every config key jax3d understands: its default, its valid range and what it means, on one line
each (`c.SECTION.KEY = DEFAULT, RANGE  # meaning`).

The comment on a key's line (and the comment lines directly above it) is its documentation:
docs/configuration.md is generated from them (scripts/config_docs.py), with each range's words.
The ranges are the vocabulary of jax3d/config/ranges.py (`POSITIVE`, `at_least(0, note)`,
`between(0, 1, high_open=True)`, `one_of(*VALUES)`, `ANY` for any value of the default's type, ...);
every key's value is checked against its range, and its default's type, before anything compiles
(`validate.check_ranges`). Settings that depend on each other are checked in rules.py.

To add a key: one line in its section (a new section is made by its first key), a range and a
comment; then `python scripts/config_docs.py`.
"""

from __future__ import annotations

import functools

import ml_collections

from jax3d.config.ranges import (
  ANY,
  FRACTION,
  NON_NEGATIVE,
  POSITIVE,
  SEED,
  Declared,
  Range,
  above,
  at_least,
  between,
  either,
  one_of,
  text,
)
from jax3d.config.rules import (
  ATTENTION_IMPLS,
  CP_STRATEGIES,
  DTYPES,
  GATHERS,
  GRAD_REDUCE_DTYPES,
  HF_MODEL_TYPES,
  PACKINGS,
  REMAT_POLICIES,
  ROPE_SCALINGS,
  SCHEDULES,
  STEP_LIST,
  SWITCH,
  TARGET_LIST,
)

SHARE = between(0, 1, low_open=True, high_open=True)  # data.eval_fraction
AXIS = either(-1, POSITIVE, 'all devices left over')  # mesh.dp, pp, tp; -1 on at most one


def base_config() -> ml_collections.ConfigDict:
  """Every key jax3d understands, with its default; `configs/*.py` start from it."""
  return declared().config


@functools.cache
def _spec() -> Declared:
  return declared()


def ranges() -> dict[str, Range]:
  """The valid range of every key, 'section.key' -> Range."""
  return _spec().ranges


def kinds() -> dict[str, type]:
  """The type of every key ('section.key' -> the type of its default)."""
  return _spec().kinds


# The key names below are a public contract (tests, scripts and users rely on them): rename nothing.
def declared() -> Declared:
  """The keys as declared below: `.config` (the defaults) and `.ranges`."""
  c = Declared()

  c.mesh.dp = -1, AXIS  # data parallel; -1 = all devices left over by the other axes
  c.mesh.pp = 1, AXIS  # pipeline stages
  c.mesh.tp = 1, AXIS  # tensor (Megatron) parallel, kept inside a host
  c.mesh.allow_tp_across_hosts = False, ANY  # refuse a tp group that spans hosts unless forced
  # context parallel: devices sharing each row's tokens (a 4th mesh axis 'cp' when > 1)
  c.mesh.cp = 1, POSITIVE

  c.pipeline.microbatches = 1, POSITIVE  # m: micro-batches per step (per grad_accum chunk)
  c.pipeline.repeats = 1, POSITIVE  # v: layer chunks per stage; > 1 = the circular schedule
  # gpipe (circular when repeats > 1; 'circular' is the same) | 1f1b: one forward and one backward
  # per tick, the loss in the loop, activation memory bounded by the stages (interleaved with repeats > 1)
  c.pipeline.schedule = 'gpipe', one_of(*SCHEDULES)
  # true | false | auto: a stage skips the work of its bubble iterations (a lax.cond); auto = on
  # CPU devices with jax >= 0.12, where fake devices share the cores (jax3d/parallel/pipeline/__init__.py)
  c.pipeline.skip_bubbles = 'auto', one_of(*SWITCH, fold_case=True)

  c.model.n_layers = 4, POSITIVE  # decoder layers; divisible by mesh.pp * pipeline.repeats
  c.model.d_model = 256, POSITIVE  # hidden size; divisible by n_heads, head size even (rotary)
  c.model.n_heads = 4, POSITIVE  # query heads; divisible by mesh.tp
  # key/value heads (grouped-query attention); divides n_heads, divisible by mesh.tp
  c.model.n_kv_heads = 4, POSITIVE
  c.model.d_ff = 1024, POSITIVE  # SwiGLU hidden size; divisible by mesh.tp
  c.model.vocab_size = 256, POSITIVE  # real vocabulary (256 for bytes); at least the data's
  # the vocabulary is padded to a multiple of this (layout-independent)
  c.model.vocab_multiple = 128, POSITIVE
  c.model.max_seq_len = 2048, POSITIVE  # longest train.seq_len allowed
  c.model.rope_theta = 10000.0, above(0)  # rotary embedding base
  c.model.norm_eps = 1e-5, between(0, 1, low_open=True)  # RMSNorm epsilon
  # size of one attention head; 0 = d_model / n_heads (Qwen3 sets its own)
  c.model.head_dim = 0, at_least(0, '0 = d_model / n_heads')
  c.model.qkv_bias = False, ANY  # biases on the query, key and value projections (Qwen2/2.5)
  c.model.qk_norm = False, ANY  # per-head RMSNorm of queries and keys before the rotation (Qwen3)
  c.model.tie_embeddings = False, ANY  # one array is the input embedding and the output head
  # none | linear | llama3 (Llama 3.1+): rotary frequencies scaled
  c.model.rope_scaling = 'none', one_of(*ROPE_SCALINGS)
  c.model.rope_factor = 1.0, at_least(1)  # linear and llama3: the context extension factor
  c.model.rope_low_freq_factor = 1.0, above(0)  # llama3: wavelengths above original/low are divided by factor
  c.model.rope_high_freq_factor = 4.0, above(0)  # llama3: wavelengths below original/high are kept
  c.model.rope_original_max_seq_len = 8192, POSITIVE  # llama3: the context the model was first trained on
  # the Hugging Face architecture an export writes: '' = the one the features need (qwen3 with
  # qk_norm, qwen2 with qkv_bias, else llama); an import sets the one it read
  c.model.hf_model_type = '', one_of(*HF_MODEL_TYPES)
  c.train.steps = 1000, NON_NEGATIVE  # optimizer steps of the whole run (the schedule decays over them)
  # sequences per optimizer step (all devices, all accumulation chunks)
  c.train.global_batch_size = 32, POSITIVE
  c.train.seq_len = 128, POSITIVE  # tokens per sequence
  c.train.seed = 0, SEED  # initialisation and data order; the batch of step i depends only on (seed, i)
  c.train.lr = 3e-3, NON_NEGATIVE  # peak learning rate (AdamW)
  c.train.min_lr_ratio = 0.1, FRACTION  # cosine decays to lr * min_lr_ratio
  c.train.warmup_steps = 50, NON_NEGATIVE  # linear warmup from 0, then cosine decay
  c.train.weight_decay = 0.1, NON_NEGATIVE  # AdamW decay of matrices (not norm scales)
  c.train.b1 = 0.9, between(0, 1, high_open=True)  # Adam beta1
  c.train.b2 = 0.95, between(0, 1, high_open=True)  # Adam beta2
  c.train.grad_clip = 1.0, at_least(0, '0 disables')  # global-norm clipping; 0 disables
  # none | dots | attn | full | stage  (see jax3d/parallel/remat.py)
  c.train.remat = 'none', one_of(*REMAT_POLICIES)
  c.train.compute_dtype = 'float32', one_of(*DTYPES)  # float32 | bfloat16
  c.train.param_dtype = 'float32', one_of(*DTYPES)  # float32 | bfloat16 (master weights and optimizer state)
  # the head and cross-entropy in this many pieces of the sequence (a scan, each piece's logits
  # recomputed in the backward): fp32 logits for 1/loss_chunks of the tokens at a time; divides seq_len
  c.train.loss_chunks = 1, POSITIVE
  c.train.grad_accum = 1, POSITIVE  # sequential chunks of the global batch per optimizer step
  c.train.max_bad_steps = 5, POSITIVE  # consecutive non-finite steps before the run stops
  c.train.inject_nan_at = '', STEP_LIST  # fault drill: comma-separated steps whose loss is made NaN
  c.train.shard_optimizer = False, ANY  # ZeRO-1: shard Adam moments over dp
  # ZeRO-3: parameters, gradients and Adam moments sharded over dp, gathered where used
  c.train.shard_params = False, ANY
  # auto | layer | step: per layer in the loop, or once per step
  c.train.shard_params_gather = 'auto', one_of(*GATHERS)
  # float32 | bfloat16 | int8 for the dp gradient reduction
  c.train.grad_reduce_dtype = 'float32', one_of(*GRAD_REDUCE_DTYPES)
  # auto: on NVIDIA GPUs in bf16/fp16 (head size a multiple of 8, <= 256) fused = cuDNN for rows of one document, Pallas for rows of documents; else blockwise | xla (dense mask, the reference) | cudnn (documents as a [b,1,t,t] bias) | pallas (Pallas Triton flash attention with segment ids; GPUs only) | blockwise (memory linear in seq)
  c.train.attention = 'auto', one_of(*ATTENTION_IMPLS)
  # Megatron-SP with tp > 1: true | false | auto (on when rows divide)
  c.train.sequence_parallel = 'false', one_of(*SWITCH, fold_case=True)
  # attention over mesh.cp > 1: allgather (K/V all-gathered over cp) | ring (K/V passed round the cp ring, ppermute)
  c.train.cp_strategy = 'allgather', one_of(*CP_STRATEGIES)

  c.data.path = '', ANY  # '' = the Python standard library's own source, as bytes
  # held-out share (by file where the corpus has files)
  c.data.eval_fraction = 0.05, SHARE
  c.data.prefetch = 2, NON_NEGATIVE  # batches prepared ahead on a background thread
  # bytes | a tokenizer.json | a SentencePiece .model | a folder with one
  c.data.tokenizer = 'bytes', text('bytes, or a path')
  # auto | concat | pack: rows of documents (docs/data.md); auto = pack for chat data, else concat
  c.data.packing = 'auto', one_of(*PACKINGS)
  # weighted sources instead of data.path: NAME=WEIGHT:PATH,... (docs/data.md, mixtures); '' = none
  c.data.mixture = '', ANY
  # weights from later steps on: STEP:NAME=WEIGHT,...;STEP:... ('' = data.mixture's weights throughout)
  c.data.mixture_stages = '', ANY

  c.log.every = 10, POSITIVE  # steps between metric records and console lines
  c.log.tensorboard = False, ANY  # also write TensorBoard event files to WORKDIR/tensorboard
  c.log.progress = True, ANY  # live progress line on a terminal
  c.log.leak_window = 20, at_least(3)  # logged steps the memory-leak detector fits its slope over
  c.log.leak_mb_per_step = 1.0, at_least(0)  # sustained growth above this (MB per step, any device) warns

  # steps between held-out evaluations (0 = only at the end)
  c.eval.every = 100, at_least(0, '0 = only at the end')
  c.eval.batches = 8, POSITIVE  # held-out batches per evaluation (fixed, the same for every layout)
  # lm-evaluation-harness tasks run during training: a comma list of names ('' = none; docs/evaluation.md)
  c.eval.tasks = '', ANY
  c.eval.tasks_every = 0, at_least(0, '0 = only at the end')  # steps between task evaluations
  c.eval.tasks_limit = 0, at_least(0, '0 = all')  # documents per task (0 = all)
  # a folder of task YAML files (tasks over local data files), searched before lm-eval's own
  c.eval.tasks_include_path = '', ANY
  # few-shot examples per prompt; -1 = the task's own
  c.eval.tasks_num_fewshot = -1, either(-1, NON_NEGATIVE, "the task's own")
  # steps between checkpoints (also at the end and on SIGTERM)
  c.checkpoint.every = 200, at_least(0, '0 = only at the end')
  c.checkpoint.keep = 3, POSITIVE  # newest checkpoints kept
  c.checkpoint.async_save = True, ANY  # write in the background while training continues
  # warm start: parameters of another run's WORKDIR, or hf:PATH (a Hugging Face model folder)
  c.checkpoint.init_from = '', ANY

  c.profile.start = -1, either(-1, NON_NEGATIVE, 'no profile')  # first profiled step; -1 = no profile
  c.profile.steps = 3, POSITIVE  # steps traced
  # per device; 0 = look it up from the device kind (unknown on CPU)
  c.hardware.peak_tflops = 0.0, at_least(0, '0 = look it up')
  # GB per device the compiled step must fit (any backend); 0 = the device's limit
  c.hardware.memory_gb = 0.0, at_least(0, "0 = the device's own limit")

  # LoRA adapters' rank r: the base frozen, only the adapters trained; 0 = off (full fine-tune)
  c.lora.rank = 0, at_least(0, '0 = no LoRA: a full fine-tune')
  c.lora.alpha = 16.0, above(0)  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
  # the projections adapted: a comma list of q,k,v,o,gate,up,down
  c.lora.targets = 'q,k,v,o,gate,up,down', TARGET_LIST
  # dropout on the adapters' input in training steps (PEFT's lora_dropout); the same masks on every layout
  c.lora.dropout = 0.0, between(0, 1, high_open=True)
  # the frozen base's storage: '' = train.param_dtype | float32 | bfloat16 | int8 (the projection
  # kernels int8 with a scale per output channel, the rest bfloat16: QLoRA-style)
  c.lora.base_dtype = '', one_of('', *DTYPES, 'int8')
  # a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) to start from
  c.lora.init_from = '', ANY

  c.sample.prompt = 'def ', ANY  # prompt of the text sample at the end of a run
  c.sample.tokens = 200, NON_NEGATIVE  # tokens generated
  c.sample.temperature = 0.8, at_least(0, '0 = greedy')  # 0 = greedy
  c.sample.top_k = 40, at_least(0, '0 = all')  # sample among the k likeliest tokens (0 = all)
  return c
