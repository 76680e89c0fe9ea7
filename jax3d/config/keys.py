"""Every config key jax3d understands, with its default and what it means (the comment on its
line, which docs/configuration.md is generated from: scripts/config_docs.py)."""

from __future__ import annotations

import ml_collections


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
  # gpipe (circular when repeats > 1; 'circular' is the same) | 1f1b: one forward and one backward
  # per tick, the loss in the loop, activation memory bounded by the stages (interleaved with repeats > 1)
  c.pipeline.schedule = 'gpipe'
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
  c.model.head_dim = 0  # size of one attention head; 0 = d_model / n_heads (Qwen3 sets its own)
  c.model.qkv_bias = False  # biases on the query, key and value projections (Qwen2/2.5)
  c.model.qk_norm = False  # per-head RMSNorm of queries and keys before the rotation (Qwen3)
  c.model.tie_embeddings = False  # one array is the input embedding and the output head
  c.model.rope_scaling = 'none'  # none | linear | llama3 (Llama 3.1+): rotary frequencies scaled
  c.model.rope_factor = 1.0  # linear and llama3: the context extension factor
  c.model.rope_low_freq_factor = 1.0  # llama3: wavelengths above original/low are divided by factor
  c.model.rope_high_freq_factor = 4.0  # llama3: wavelengths below original/high are kept
  c.model.rope_original_max_seq_len = 8192  # llama3: the context the model was first trained on
  # the Hugging Face architecture an export writes: '' = the one the features need (qwen3 with
  # qk_norm, qwen2 with qkv_bias, else llama); an import sets the one it read
  c.model.hf_model_type = ''
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
  c.train.remat = 'none'  # none | dots | attn | full | stage  (see jax3d/parallel/remat.py)
  c.train.compute_dtype = 'float32'  # float32 | bfloat16
  c.train.param_dtype = 'float32'  # float32 | bfloat16 (master weights and optimizer state)
  # the head and cross-entropy in this many pieces of the sequence (a scan, each piece's logits
  # recomputed in the backward): fp32 logits for 1/loss_chunks of the tokens at a time; divides seq_len
  c.train.loss_chunks = 1
  c.train.grad_accum = 1  # sequential chunks of the global batch per optimizer step
  c.train.max_bad_steps = 5  # consecutive non-finite steps before the run stops
  c.train.inject_nan_at = ''  # fault drill: comma-separated steps whose loss is made NaN
  c.train.shard_optimizer = False  # ZeRO-1: shard Adam moments over dp
  # ZeRO-3: parameters, gradients and Adam moments sharded over dp, gathered where used
  c.train.shard_params = False
  c.train.shard_params_gather = 'auto'  # auto | layer | step: per layer in the loop, or once per step
  c.train.grad_reduce_dtype = 'float32'  # float32 | bfloat16 | int8 for the dp gradient reduction
  c.train.attention = 'auto'  # auto | xla | cudnn  (jax.nn.dot_product_attention implementation)
  c.train.sequence_parallel = 'false'  # Megatron-SP with tp > 1: true | false | auto (on when rows divide)

  c.data = ml_collections.ConfigDict()
  c.data.path = ''  # '' = the Python standard library's own source, as bytes
  c.data.eval_fraction = 0.05  # held-out share (by file where the corpus has files)
  c.data.prefetch = 2  # batches prepared ahead on a background thread
  c.data.tokenizer = 'bytes'  # bytes | a tokenizer.json | a SentencePiece .model | a folder with one
  # auto | concat | pack: rows of documents (docs/data.md); auto = pack for chat data, else concat
  c.data.packing = 'auto'

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

  c.lora = ml_collections.ConfigDict()
  c.lora.rank = (
    0  # LoRA adapters' rank r: the base frozen, only the adapters trained; 0 = off (full fine-tune)
  )
  c.lora.alpha = 16.0  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
  c.lora.targets = 'q,k,v,o,gate,up,down'  # the projections adapted: a comma list of q,k,v,o,gate,up,down
  c.lora.dropout = 0.0  # dropout on the adapters' input (PEFT's lora_dropout); only 0 is supported
  c.lora.base_dtype = ''  # the frozen base's storage: '' = train.param_dtype | float32 | bfloat16
  c.lora.init_from = (
    ''  # a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) to start from
  )

  c.sample = ml_collections.ConfigDict()
  c.sample.prompt = 'def '  # prompt of the text sample at the end of a run
  c.sample.tokens = 200  # tokens generated
  c.sample.temperature = 0.8  # 0 = greedy
  c.sample.top_k = 40  # sample among the k likeliest tokens (0 = all)
  return c
