"""A byte-level BPE tokenizer trained with `tokenizers` (`jax3d.prepare --train_tokenizer=VOCAB`).
Imports no jax."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

EOS_TOKEN = '<|endoftext|>'


def train_tokenizer(texts: Iterator[str], vocab_size: int, out_file: str) -> None:
  """A byte-level BPE tokenizer (lossless: decode(encode(text)) == text) with one special token,
  EOS '<|endoftext|>', trained on `texts` and saved as `out_file` (tokenizer.json), with a
  tokenizer_config.json beside it for transformers."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=[EOS_TOKEN],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(texts, trainer)
  tok.save(out_file)
  cfg = {'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': EOS_TOKEN, 'bos_token': None}
  with open(os.path.join(os.path.dirname(out_file), 'tokenizer_config.json'), 'w') as f:
    json.dump(cfg | {'clean_up_tokenization_spaces': False}, f, indent=2)
