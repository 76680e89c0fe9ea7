"""Fine-tuning an imported Hugging Face Llama on your own text (see the README's fine-tuning recipe).

python -m jax3d.prepare --input=my_text/ --out=data/mine --tokenizer=PATH_TO_HF_MODEL
python -m jax3d.train --config=finetune --config.checkpoint.init_from=hf:PATH_TO_HF_MODEL \\
    --config.data.path=data/mine --workdir=runs/ft

The model (layers, widths, heads, vocabulary, rope theta, norm epsilon) comes from the checkpoint's
config.json and its tokenizer from the same folder; this file sets what fine-tuning changes: a
small learning rate with a short warmup, no weight decay on a short run, frequent evaluation.
The layout is dp=2 x pp=2 x tp=2 on 8 devices; any other that divides the model's heads works.
"""

import ml_collections

from jax3d.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.mesh.dp, c.mesh.pp, c.mesh.tp = 2, 2, 2
  c.pipeline.microbatches = 4
  c.train.steps = 200
  c.train.global_batch_size = 16
  c.train.seq_len = 256
  c.train.lr = 2e-5
  c.train.min_lr_ratio = 0.1
  c.train.warmup_steps = 10
  c.train.weight_decay = 0.0
  c.train.grad_clip = 1.0
  c.eval.every = 50
  c.checkpoint.every = 100
  c.sample.prompt = 'The '
  c.sample.tokens = 60
  return c
