"""jax3d as an lm-evaluation-harness model: `JaxLM`, an `lm_eval.api.model.TemplateLM` (the `LM`
interface with lm-eval's own request encoding: context/continuation split, the prefix token of an
empty context, as its `hf` model does) over a built run (Setup) and its parameters, any layout.

  loglikelihood(_rolling)  requests packed as documents into rows (jax3d/harness/rows.py), scored
                           by the eval step's program (jax3d/scoring.py), one chunk of
                           rows (plan.chunk_batch x plan.seq_len) per step; rolling windows are
                           lm-eval's own (`get_rolling_token_windows`), each window a request
  generate_until           the KV-cache decoder (jax3d/model/generate.py), one request at a time:
                           greedy (or the task's temperature), up to max_gen_toks tokens or EOS,
                           the text cut at the first `until` string (lm-eval's post-processing)

`max_length` (default train.seq_len) plays the part of the `hf` model's max_length: requests
keep their last max_length + 1 tokens, prompts their last max_length - max_gen_toks.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models import utils as model_utils

from jax3d import scoring
from jax3d.data import global_batch, tokenizer as tok_lib
from jax3d.errors import UsageError
from jax3d.harness import rows as rows_lib
from jax3d.model import generate
from jax3d.setup import Setup

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's `hf` model's default


class JaxLM(TemplateLM):
  """lm-eval's model interface on a jax3d run (see the module docstring). `stats` counts the
  work done: requests, rows, filled slots, steps and seconds of the log-likelihood requests."""

  def __init__(self, setup: Setup, params: Any, max_length: int | None = None) -> None:
    super().__init__()
    self.setup, self.params = setup, params
    self.tok = tok_lib.load(setup.cfg.data.tokenizer)
    self._max_length = max_length or setup.plan.seq_len
    if self._max_length > setup.plan.seq_len:
      raise UsageError(
        f'max_length={self._max_length} is longer than a row (train.seq_len={setup.plan.seq_len})'
      )
    self._score = None
    self.stats = {'requests': 0, 'rows': 0, 'slots': 0, 'steps': 0, 'seconds': 0.0}

  # --- tokens --------------------------------------------------------------------------------
  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def eot_token_id(self) -> int:
    # a tokenizer without EOS (bytes): newline, the decoder's own fallback for an empty prompt
    return self.tok.eos_id if self.tok.eos_id is not None else 10

  @property
  def prefix_token_id(self) -> int:
    return self.tok.bos_id if self.tok.bos_id is not None else self.eot_token_id

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
    """The ids as the `hf` model encodes: the tokenizer's special tokens unless asked not to, or
    unless the text already starts with the BOS text."""
    if add_special_tokens is None:
      bos = self._token_text(self.prefix_token_id)
      add_special_tokens = not (bos and string.startswith(bos))
    return self.tok.encode(string, add_special_tokens=add_special_tokens)

  def _token_text(self, token: int) -> str:
    """One token's text with special tokens kept (the `hf` model's stop string for EOS)."""
    inner = getattr(self.tok, 'tok', None)  # a tokenizer.json's
    return inner.decode([token], skip_special_tokens=False) if inner is not None else self.tok.decode([token])

  # --- log-likelihoods ------------------------------------------------------------------------
  def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list:
    """(sum of the continuation's log-probabilities, whether every continuation token is the
    argmax) of each request (context, continuation) as token ids."""
    pairs = [(ctx, cont) for _, ctx, cont in requests]
    total, greedy = self.score_tokens(pairs)
    out = [(float(t), bool(g)) for t, g in zip(total, greedy, strict=True)]
    for (key, _, _), res in zip(requests, out, strict=True):
      if key is not None:
        self.cache_hook.add_partial('loglikelihood', key, res)
    return out

  def score_tokens(self, pairs: list[tuple[list[int], list[int]]]) -> tuple[np.ndarray, np.ndarray]:
    """(log-likelihood, is greedy) arrays of the (context, continuation) id pairs: all of them
    packed into rows, one chunk of rows per step of the score program."""
    if not pairs:
      return np.zeros(0), np.zeros(0, bool)
    t0 = time.perf_counter()
    s = self.setup
    packed = rows_lib.pack(pairs, self._max_length)
    chunk, seq = s.plan.chunk_batch, s.plan.seq_len
    local = global_batch.process_rows(s.batch_sharding, chunk)
    if self._score is None:
      self._score = scoring.make_score_step(s)
    total = np.zeros(len(pairs))
    missed = np.zeros(len(pairs), np.int64)
    for first in range(0, packed.n_rows, chunk):
      ids = np.arange(first, min(first + chunk, packed.n_rows))
      arrays = packed.layout.rows(ids)
      if seq > self._max_length:  # rows of max_length slots in the step's seq_len
        arrays = {k: np.pad(v, ((0, 0), (0, seq - self._max_length))) for k, v in arrays.items()}
      padded = {k: np.pad(v, ((0, chunk - len(ids)), (0, 0))) for k, v in arrays.items()}
      batch = global_batch.to_global({k: v[local] for k, v in padded.items()}, s.batch_sharding, chunk)
      logp, is_greedy = jax.device_get(self._score(self.params, batch))
      n = len(ids)
      t, m, _ = packed.sums(ids, arrays, np.asarray(logp)[:n], np.asarray(is_greedy)[:n])
      total, missed = total + t, missed + m
      self.stats['steps'] += 1
    self.stats['requests'] += len(pairs)
    self.stats['rows'] += packed.n_rows
    self.stats['slots'] += packed.slots
    self.stats['seconds'] += time.perf_counter() - t0
    return total, missed == 0

  def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
    """The log-likelihood of whole texts: lm-eval's disjoint rolling windows of max_length tokens
    (the first predicted from the prefix token), all windows of all texts packed together."""
    windows, owner = [], []
    for i, (string,) in enumerate(req.args for req in requests):
      for ctx, cont in map(
        lm_utils.make_disjoint_window,
        lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(string),
          prefix_token=self.prefix_token_id,
          max_seq_len=self._max_length,
          context_len=1,
        ),
      ):
        windows.append((ctx, cont))
        owner.append(i)
    total = np.zeros(len(requests))
    np.add.at(total, np.asarray(owner, np.int64), self.score_tokens(windows)[0])
    for req, value in zip(requests, total, strict=True):
      self.cache_hook.add_partial('loglikelihood_rolling', req.args, float(value))
    return [float(v) for v in total]

  # --- generation -----------------------------------------------------------------------------
  def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
    """Each request's continuation: the KV-cache decoder from its context, cut at `until`."""
    s, out = self.setup, []
    layout = (s.cfg.model.n_layers, s.plan.pp, s.plan.repeats)
    eos = self._token_text(self.tok.eos_id) if self.tok.eos_id is not None else None
    for req in requests:
      context, gen_kwargs = req.args
      kwargs = model_utils.normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS)
      until = model_utils.handle_stop_sequences(kwargs.pop('until', None), eos=eos)
      max_gen = int(kwargs.pop('max_gen_toks'))
      room = self._max_length - max_gen
      if room <= 0:
        raise UsageError(
          f"a generation task asks for max_gen_toks={max_gen} tokens, not less than the model's "
          f'max_length={self._max_length} (train.seq_len): set generation_kwargs.max_gen_toks lower '
          'in the task, or a longer --config.train.seq_len'
        )
      ids = self.tok_encode(context)[-room:]
      toks = generate.generate(
        s.dims,
        self.params,
        layout,
        ids,
        max_gen,
        s.cfg.model.max_seq_len,
        temperature=float(kwargs.get('temperature', 0.0)) if kwargs.get('do_sample') else 0.0,
        top_k=0,
        seed=int(kwargs.get('seed', 0) or 0),
        stop=self.tok.eos_id,
      )
      text = model_utils.postprocess_generated_text(self.tok.decode(toks), until, None)
      self.cache_hook.add_partial('generate_until', (context, gen_kwargs), text)
      out.append(text)
    return out
