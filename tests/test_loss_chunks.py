"""train.loss_chunks: the head and cross-entropy in pieces of the sequence give the numbers of the
whole (losses and step-1 gradients, rtol 1e-5) on every layout and schedule, tied or not, weighted or
not, with sequence parallelism; and the compiled step's temporary memory drops with the pieces."""

import functools

import chex
import jax
import numpy as np
import pytest
from test_documents import _check_against, weighted_batches
from test_equivalence import check

import jax3d
from jax3d import config as config_lib
from jax3d.model import llama

from helpers import setup_for, small_cfg

LAYOUTS = {
  '8-1-1': {'mesh__dp': 8},
  '4-1-2-sp': {'mesh__dp': 4, 'mesh__tp': 2, 'train__sequence_parallel': 'true'},
  '2-2-2-m2': {'mesh__dp': 2, 'mesh__pp': 2, 'mesh__tp': 2, 'pipeline__microbatches': 2},
  '2-2-2-m2-1f1b': {
    'mesh__dp': 2,
    'mesh__pp': 2,
    'mesh__tp': 2,
    'pipeline__microbatches': 2,
    'pipeline__schedule': '1f1b',
  },
  '2-4-1-m4': {'mesh__dp': 2, 'mesh__pp': 4, 'pipeline__microbatches': 4},
  '2-4-1-m4-1f1b': {'mesh__dp': 2, 'mesh__pp': 4, 'pipeline__microbatches': 4, 'pipeline__schedule': '1f1b'},
}


@pytest.mark.parametrize(
  'name,chunks',
  [pytest.param(n, c, marks=pytest.mark.slow) for n in LAYOUTS for c in (2, 8)],
)
def test_loss_chunks_equal_one_piece(name, chunks):
  check({**LAYOUTS[name], 'train__loss_chunks': chunks})


@pytest.mark.slow
@pytest.mark.parametrize('name', ['2-2-2-m2', '2-4-1-m4-1f1b'])
def test_loss_chunks_tied_embeddings(name):
  tied = {'model__tie_embeddings': True}
  check({**LAYOUTS[name], **tied, 'train__loss_chunks': 4}, ref_over=tuple(tied.items()))


@pytest.mark.slow
@pytest.mark.parametrize('name', ['4-1-2-sp', '2-2-2-m2-1f1b'])
def test_loss_chunks_weighted_rows(name):
  from helpers import run_steps

  _check_against(
    run_steps(small_cfg(), batches=weighted_batches()), {**LAYOUTS[name], 'train__loss_chunks': 8}
  )


def test_head_loss_in_pieces_equals_one_piece():
  """The model's head and loss (llama.head_loss_sum, which every layout and schedule runs with
  train.loss_chunks pieces) in 2 and 16 pieces with weights, 4 without: the sum and its gradients
  (head parameters, the last layer's output) of one piece, rtol 1e-5. The end-to-end runs on
  layouts are the slow tests above; that the step takes train.loss_chunks is
  test_compiled_temp_memory_drops_with_loss_chunks."""
  s = setup_for(small_cfg(model__n_layers=1))
  params = jax.jit(lambda k: llama.init_params(k, s.dims, np.arange(1)))(jax.random.key(0))
  head = {k: v for k, v in params.items() if k != 'layers'}  # what llama.head_apply may read
  rng = np.random.default_rng(0)
  rows, seq = 4, 16
  y_btd = rng.standard_normal((rows, seq, s.dims.d_model), np.float32)
  targets = rng.integers(0, s.dims.vocab_size, (rows, seq)).astype(np.int32)
  weights = (rng.random((rows, seq)) * (rng.random((rows, seq)) < 0.7)).astype(np.float32)

  @functools.partial(jax.jit, static_argnums=(0, 1))
  def value_and_grads(chunks, weighted, head, y_btd):
    w = weights if weighted else None
    f = lambda h, y: llama.head_loss_sum(s.dims, h, y, targets, w, chunks)
    return jax.value_and_grad(f, argnums=(0, 1))(head, y_btd)

  for chunks, weighted in ((2, True), (16, True), (4, False)):
    ref_loss, ref_grads = value_and_grads(1, weighted, head, y_btd)
    assert float(ref_loss) > 1.0 and np.abs(ref_grads[1]).max() > 1e-3  # not a trivial sum
    loss, grads = value_and_grads(chunks, weighted, head, y_btd)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5, err_msg=f'{chunks} pieces')
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-5, atol=1e-6)


def test_loss_chunks_must_divide_seq_len():
  with pytest.raises(
    config_lib.ConfigError, match=r'train\.loss_chunks=3 .*divisor of train\.seq_len=16.*1, 2, 4, 8, 16'
  ):
    config_lib.validate(small_cfg(train__loss_chunks=3), 1)


def test_compiled_temp_memory_drops_with_loss_chunks():
  """An 8K-entry head on one device: the fp32 logits (and their gradient) dominate the step's
  temporaries; in 8 pieces only an eighth of them exist at a time."""
  rows, seq, vocab = 4, 32, 8192
  over = {'model__vocab_size': vocab, 'train__seq_len': seq, 'train__global_batch_size': rows}
  cfg = lambda c: small_cfg(**over, model__n_layers=1, train__loss_chunks=c)
  temp = {c: jax3d.compiled_memory(cfg(c), jax.devices()[:1])['temp'] for c in (1, 8)}
  logits = rows * seq * vocab * 4
  assert temp[1] - temp[8] > 1.5 * logits * (1 - 1 / 8), temp


def test_cost_model_and_oom_ladder_know_loss_chunks():
  """The head's logits term is for one piece; where it outweighs the layers' activations (a 128K
  vocabulary at tp=1), the ladder offers more pieces, priced."""
  from jax3d.planning import memory_model, oom

  big = {'model.vocab_size': 128256, 'train.seq_len': 2048, 'train.global_batch_size': 8}
  big |= {'mesh.dp': 1, 'mesh.pp': 1, 'mesh.tp': 1}
  heads = {}
  for c in (1, 8):
    cfg = config_lib.load_config('tiny', big | {'train.loss_chunks': c})
    heads[c] = memory_model.head_bytes(cfg, config_lib.validate(cfg, 1))
  embed_out = 2048 * 8 * 2 * 256 * 4  # the embedding's output, not chunked
  assert heads[1] - embed_out == pytest.approx(8 * (heads[8] - embed_out))
  cfg = config_lib.load_config('tiny', big)
  ladder = oom.oom_ladder(cfg, config_lib.validate(cfg, 1), 2e9)
  assert any('--config.train.loss_chunks=8' in rung for rung in ladder), ladder
