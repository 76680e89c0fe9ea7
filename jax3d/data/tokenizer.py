"""Tokenizers: bytes (the default), a Hugging Face `tokenizer.json`, or a SentencePiece model.

  tok = tokenizer.load('bytes')                  # vocabulary 256, no BOS/EOS
  tok = tokenizer.load('runs/data/tokenizer.json')  # the `tokenizers` library
  tok = tokenizer.load('llama/tokenizer.model')  # SentencePiece
  tok = tokenizer.load('llama/')                 # a folder holding either
  ids = tok.encode('def f():'); tok.decode(ids)

`data.tokenizer` names one of these. The model's vocabulary is the tokenizer's (`vocab_size`,
padded as always); `bos_id`/`eos_id` are None where the tokenizer has none. Documents are separated
by EOS in token shards (jax3d.prepare). A document and a sampling prompt get the special tokens
the tokenizer itself adds (`add_special_tokens=True`: a tokenizer.json's post-processor; for
SentencePiece, tokenizer_config.json's add_bos_token / add_eos_token, BOS by default), as
transformers encodes them: never a rule of jax3d's.
Nothing here imports jax; `tokenizers` and `sentencepiece` are imported only when used.
"""

from __future__ import annotations

import json
import os
from typing import Any

from jax3d.config import ConfigError

BYTES = 'bytes'
# Special tokens a `tokenizer.json` may use for BOS / EOS when no tokenizer_config.json says so
# (Llama 2 / Mistral, Llama 3, GPT-2 style and jax3d.prepare's own).
BOS_NAMES = ('<s>', '<|begin_of_text|>', '<|bos|>')
EOS_NAMES = ('</s>', '<|end_of_text|>', '<|endoftext|>', '<|eos|>')


class Tokenizer:
  """The bytes tokenizer (UTF-8 bytes, vocabulary 256); the subword ones override encode/decode."""

  name = BYTES
  path = ''
  vocab_size = 256
  bos_id: int | None = None
  eos_id: int | None = None

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of `text`; with `add_special_tokens` the ones the tokenizer adds (none here)."""
    return list(text.encode('utf-8'))

  def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
    """Token ids of each text (see `encode`)."""
    return [self.encode(t, add_special_tokens) for t in texts]

  def decode(self, ids: list[int]) -> str:
    """The text of `ids` (special tokens and ids past the byte range dropped, bad UTF-8 replaced)."""
    return bytes(i for i in ids if 0 <= i < 256).decode('utf-8', errors='replace')

  def describe(self) -> str:
    """One line: kind, vocabulary, BOS/EOS ids, file."""
    where = f' ({self.path})' if self.path else ''
    return f'{self.name}{where}: vocab {self.vocab_size}, bos {self.bos_id}, eos {self.eos_id}'


class HFTokenizer(Tokenizer):
  """A `tokenizer.json` read with the `tokenizers` library."""

  name = 'tokenizers'

  def __init__(self, path: str):
    from tokenizers import Tokenizer as _Tok

    self.path = os.path.abspath(path)
    self.tok = _Tok.from_file(self.path)
    self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
    named = _special_tokens_from_config(os.path.dirname(self.path))
    ids = lambda names: [i for n in names if (i := self.tok.token_to_id(n)) is not None]
    bos = ids([named['bos']] if named.get('bos') else BOS_NAMES)
    eos = ids([named['eos']] if named.get('eos') else EOS_NAMES)
    self.bos_id = bos[0] if bos else None
    self.eos_id = eos[0] if eos else None

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

  def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
    return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

  def decode(self, ids: list[int]) -> str:
    return self.tok.decode([i for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=True)


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece `.model` file."""

  name = 'sentencepiece'

  def __init__(self, path: str):
    import sentencepiece

    self.path = os.path.abspath(path)
    self.sp = sentencepiece.SentencePieceProcessor(model_file=self.path)
    self.vocab_size = self.sp.get_piece_size()
    self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
    self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
    adds = _config(os.path.dirname(self.path))  # transformers' LlamaTokenizer defaults
    self.adds = (adds.get('add_bos_token', True), adds.get('add_eos_token', False))

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    return self.encode_batch([text], add_special_tokens)[0]

  def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
    ids = self.sp.encode(texts)
    if not add_special_tokens:
      return ids
    bos = [self.bos_id] if self.adds[0] and self.bos_id is not None else []
    eos = [self.eos_id] if self.adds[1] and self.eos_id is not None else []
    return [bos + x + eos for x in ids]

  def decode(self, ids: list[int]) -> str:
    return self.sp.decode([i for i in ids if 0 <= i < self.vocab_size])


def _config(folder: str) -> dict:
  """The tokenizer_config.json beside the tokenizer ({} when there is none or it does not parse)."""
  path = os.path.join(folder, 'tokenizer_config.json')
  if not os.path.exists(path):
    return {}
  try:
    with open(path) as f:
      cfg = json.load(f)
  except (OSError, ValueError):
    return {}
  return cfg if isinstance(cfg, dict) else {}


def _special_tokens_from_config(folder: str) -> dict[str, str]:
  """bos/eos token strings from a tokenizer_config.json beside the tokenizer, where there is one."""
  cfg = _config(folder)
  text = lambda v: v.get('content') if isinstance(v, dict) else v
  return {
    k: text(cfg.get(f'{k}_token')) for k in ('bos', 'eos') if isinstance(text(cfg.get(f'{k}_token')), str)
  }


def bos_note(tok: Tokenizer) -> str | None:
  """One line when the tokenizer defines a BOS token that its own encoding does not add (a model
  trained with BOS before every document would then see prompts without it), else None."""
  if tok.bos_id is None or tok.encode('a', add_special_tokens=True)[:1] == [tok.bos_id]:
    return None
  return (
    f'{tok.path} defines BOS (id {tok.bos_id}) but does not add it when encoding; prompts and '
    'documents are encoded without it, as transformers does (put it in the text if the model needs it)'
  )


def prompt_ids(tok: Tokenizer, prompt: str, n_tokens: int, max_len: int) -> list[int]:
  """The prompt's token ids (with the special tokens the tokenizer adds itself); ConfigError when
  it leaves no room in the model's context (`max_len`, model.max_seq_len) for the `n_tokens` > 0
  to generate: the context would drop the prompt's start, and the text not continue it."""
  ids = tok.encode(prompt, add_special_tokens=True)
  if n_tokens > 0 and len(ids) >= max_len:
    raise ConfigError(
      f'the prompt (--prompt, sample.prompt) is {len(ids):,} tokens, and the model reads at most '
      f'model.max_seq_len={max_len:,}: give a prompt of at most {max_len - 1:,} tokens, to leave room '
      'for the text generated'
    )
  return ids


def check_prompt(cfg: Any, prompt: str | None, n_tokens: int | None) -> None:
  """`prompt_ids` for a run's config (its tokenizer, model.max_seq_len; sample.prompt and
  sample.tokens where None): a sampling command checks the prompt before the weights load."""
  prompt, n_tokens = (
    cfg.sample[k] if v is None else v for k, v in (('prompt', prompt), ('tokens', n_tokens))
  )
  prompt_ids(load(cfg.data.tokenizer), prompt, n_tokens, cfg.model.max_seq_len)


def find(spec: str) -> str:
  """The tokenizer file `spec` names: 'bytes', a tokenizer.json / .model file, or a folder holding
  tokenizer.json (preferred) or tokenizer.model. ConfigError when there is none."""
  if spec == BYTES:
    return BYTES
  if os.path.isdir(spec):
    for name in ('tokenizer.json', 'tokenizer.model'):
      if os.path.exists(os.path.join(spec, name)):
        return os.path.abspath(os.path.join(spec, name))
    raise ConfigError(f'data.tokenizer={spec!r}: the folder holds no tokenizer.json or tokenizer.model')
  if not os.path.exists(spec):
    raise ConfigError(
      f"data.tokenizer={spec!r} does not exist (give 'bytes', a tokenizer.json, a SentencePiece "
      '.model file, or a folder holding one)'
    )
  return os.path.abspath(spec)


_CACHE: dict[str, Tokenizer] = {}


def load(spec: str) -> Tokenizer:
  """The tokenizer `spec` names (see `find`); ConfigError naming the file when it does not load."""
  path = find(spec)
  if path in _CACHE:
    return _CACHE[path]
  if path == BYTES:
    tok: Tokenizer = Tokenizer()
  else:
    try:
      tok = HFTokenizer(path) if path.endswith('.json') else SentencePieceTokenizer(path)
    except Exception as e:  # noqa: BLE001 - any parse failure is bad input naming the file
      kind = 'tokenizer.json (tokenizers)' if path.endswith('.json') else 'SentencePiece model'
      raise ConfigError(f'data.tokenizer={spec!r}: {path} is not a valid {kind}: {str(e)[:200]}') from None
  _CACHE[path] = tok
  return tok


def fingerprint(tok: Any) -> str:
  """sha256 of the tokenizer file ('bytes' for the bytes tokenizer): token shards record it."""
  if not tok.path:
    return BYTES
  import hashlib

  with open(tok.path, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()
