"""Rows of documents reach the model (issue 31): attention never crosses a segment, rotary positions
are the batch's, and the loss is sum(w * CE) / sum(w) over the global batch, on every layout.

  * a document's logits and loss do not change when its neighbour in the row changes, and packed
    rows give the losses of each document alone in a row (within 1e-5), on the equivalence
    matrix's layouts, sequence parallelism and 1F1B included;
  * the weighted loss and its gradients equal one device across layouts, micro-batch counts,
    grad_accum and ZeRO-1; masked targets get zero gradient;
  * positions reach rotary (a row with gaps in its positions equals transformers at those
    position_ids), and a 3-step fine-tune on packed rows equals transformers + torch AdamW run on
    each document alone at its positions.
"""

import chex
import jax
import numpy as np
import pytest

from jax3d import loss as loss_lib, step as step_lib
from jax3d.data import packing
from jax3d.parallel import sharding

from helpers import run_steps, setup_for, small_cfg

ROWS, SEQ, VOCAB = 32, 16, 256  # helpers.SMALL's batch


def _row_of(docs: list[tuple[np.ndarray, np.ndarray]], seq: int) -> dict[str, np.ndarray]:
  """One row of `seq` slots holding `docs` ((tokens of n + 1, weights of n) each) in order, then
  padding: the layout data.packing writes."""
  row = {k: v[0] for k, v in packing.empty_rows(1, seq).items()}
  at = 0
  for seg, (toks, w) in enumerate(docs, start=1):
    n = len(toks) - 1
    sl = slice(at, at + n)
    row['inputs'][sl], row['targets'][sl], row['weights'][sl] = toks[:-1], toks[1:], w
    row['segment_ids'][sl], row['positions'][sl] = seg, np.arange(n)
    at += n
  return row


def _stack(rows: list[dict]) -> dict[str, np.ndarray]:
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def neighbour_batches(seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
  """Rows of two documents A then B (and 0-3 slots of padding); the same rows with A's tokens
  changed ('a_changed') and with B's changed ('b_changed'); each document alone ('a_alone',
  'b_alone'). Weights: 1 on A ('..._a') or on B ('..._b')."""
  rng = np.random.default_rng(seed)
  out: dict[str, list] = {}
  for _ in range(ROWS):
    la = int(rng.integers(3, SEQ // 2))
    lb = SEQ - la - int(rng.integers(0, 4))
    a, a2 = (rng.integers(1, VOCAB, la + 1) for _ in range(2))
    b, b2 = (rng.integers(1, VOCAB, lb + 1) for _ in range(2))
    one = lambda n, v: np.full(n, v, np.float32)
    for tag, (x, y) in {'': (a, b), 'a_changed': (a2, b), 'b_changed': (a, b2)}.items():
      for on in ('a', 'b'):
        wa, wb = one(la, on == 'a'), one(lb, on == 'b')
        out.setdefault(f'{tag or "packed"}_{on}', []).append(_row_of([(x, wa), (y, wb)], SEQ))
    out.setdefault('alone_a', []).append(_row_of([(a, one(la, 1))], SEQ))
    out.setdefault('alone_b', []).append(_row_of([(b, one(lb, 1))], SEQ))
  return {k: _stack(v) for k, v in out.items()}


def _eval_and_logits(over: dict, batches: dict) -> tuple[dict, dict]:
  """The eval step's weighted mean loss of each batch and (outside 1F1B) its logits, on the layout
  `over` (small_cfg overrides), from the seed's parameters."""
  s = setup_for(small_cfg(**over))
  params = step_lib.make_init(s)(0)['params']
  ev = step_lib.make_eval_step(s)
  put = lambda b: {k: jax.device_put(v, s.batch_sharding) for k, v in b.items()}
  losses = {k: float(ev(params, put(b))) for k, b in batches.items()}
  if s.cfg.pipeline.schedule == '1f1b':
    return losses, {}

  def fn(p, b):
    with sharding.use_rules(s.rules):
      return loss_lib.logits(p, b['inputs'], s, doc={k: b[k] for k in loss_lib.DOC_KEYS if k in b})

  lg = step_lib.MeshJit(fn, s.mesh)
  logits = {k: np.asarray(lg(params, put(batches[k]))) for k in ('packed_a', 'a_changed_a', 'b_changed_a')}
  return losses, logits


LAYOUTS = {
  '1-1-1': {},
  '2-2-2': {'mesh__dp': 2, 'mesh__pp': 2, 'mesh__tp': 2, 'pipeline__microbatches': 4},
  '1-2-4': {'mesh__pp': 2, 'mesh__tp': 4, 'pipeline__microbatches': 2},
  '1-4-2': {'mesh__pp': 4, 'mesh__tp': 2, 'pipeline__microbatches': 4},
  '2-1-4-sp': {'mesh__dp': 2, 'mesh__tp': 4, 'train__sequence_parallel': 'true'},
  '2-2-2-circular': {
    'mesh__dp': 2,
    'mesh__pp': 2,
    'mesh__tp': 2,
    'pipeline__microbatches': 2,
    'pipeline__repeats': 2,
    'pipeline__schedule': 'circular',
  },
  '1-2-4-sp-1f1b': {
    'mesh__pp': 2,
    'mesh__tp': 4,
    'pipeline__microbatches': 4,
    'pipeline__schedule': '1f1b',
    'train__sequence_parallel': 'true',
  },
  '2-2-2-1f1b': {
    'mesh__dp': 2,
    'mesh__pp': 2,
    'mesh__tp': 2,
    'pipeline__microbatches': 4,
    'pipeline__schedule': '1f1b',
  },
}
FAST_LAYOUTS = ('2-2-2', '2-2-2-1f1b')


@pytest.fixture(scope='module')
def one_device():
  batches = neighbour_batches()
  return batches, _eval_and_logits({}, batches)


@pytest.mark.parametrize(
  'name', [pytest.param(n, marks=() if n in FAST_LAYOUTS else pytest.mark.slow) for n in LAYOUTS]
)
def test_a_document_does_not_see_its_neighbour(name, one_device):
  batches, (r_losses, r_logits) = one_device
  losses, logits = _eval_and_logits(LAYOUTS[name], batches)
  for on in ('a', 'b'):
    alone = losses[f'alone_{on}']
    for k in (f'packed_{on}', f'a_changed_{on}', f'b_changed_{on}'):
      if k[0] != on:  # the neighbour changed (or nothing): the document's loss is its loss alone
        np.testing.assert_allclose(losses[k], alone, rtol=1e-5, err_msg=k)
    np.testing.assert_allclose(alone, r_losses[f'alone_{on}'], rtol=1e-5)
  for k, v in logits.items():  # same logits as one device, and each document's own unchanged
    np.testing.assert_allclose(v, r_logits[k], rtol=1e-5, atol=1e-5 * float(np.abs(v).max()))
  if logits:
    seg = batches['packed_a']['segment_ids']
    scale = float(np.abs(logits['packed_a']).max())
    for changed, keep in (('a_changed_a', 2), ('b_changed_a', 1)):
      m = seg == keep
      np.testing.assert_allclose(logits[changed][m], logits['packed_a'][m], rtol=0, atol=1e-5 * scale)
      assert np.abs(logits[changed][seg == 3 - keep] - logits['packed_a'][seg == 3 - keep]).max() > 1e-2


# --- the weighted loss against one device ---------------------------------------------------------
def weighted_batches(n: int = 3, seed: int = 1) -> list[dict[str, np.ndarray]]:
  """Rows of 1-3 documents with random 0 / 1 / fractional weights and padding (packed by
  first-fit as data.packing=pack does)."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    sizes = rng.integers(2, SEQ + 4, 3 * ROWS)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    toks = rng.integers(0, VOCAB, starts[-1])
    w = np.where(rng.random(starts[-1]) < 0.6, rng.choice([1.0, 0.5, 2.0], starts[-1]), 0.0)
    docs = packing.Documents(toks, starts, (w * 2).astype(np.uint8))  # shards hold uint8 weights
    rows = packing.layout(docs, SEQ, 'pack').rows(np.arange(ROWS))
    rows['weights'] = rows['weights'] / 2  # back to 0, 0.25, 0.5, 1
    out.append(rows)
  return out


@pytest.fixture(scope='module')
def weighted_reference():
  return run_steps(small_cfg(), batches=weighted_batches())


def _check_against(reference, over):
  losses, grads, params = run_steps(small_cfg(**over), batches=weighted_batches())
  r_losses, r_grads, r_params = reference
  chex.assert_trees_all_close(params, r_params, rtol=0, atol=0)
  np.testing.assert_allclose(losses, r_losses, rtol=1e-5)
  chex.assert_trees_all_close(grads, r_grads, rtol=1e-5, atol=1e-7)


WEIGHTED = {
  '2-2-2-accum2': {
    'mesh__dp': 2,
    'mesh__pp': 2,
    'mesh__tp': 2,
    'pipeline__microbatches': 2,
    'train__grad_accum': 2,
  },
  '8-1-1': {'mesh__dp': 8},
  # the explicit-dp path (data_parallel's shard_map; also that of train.grad_reduce_dtype): every
  # dp rank divides by the global sum(w), not its own rows'
  '8-1-1-zero1': {'mesh__dp': 8, 'train__shard_optimizer': True},
  '4-2-1-m8': {'mesh__dp': 4, 'mesh__pp': 2, 'pipeline__microbatches': 8},
  '2-2-2-zero1-accum2': {
    'mesh__dp': 2,
    'mesh__pp': 2,
    'mesh__tp': 2,
    'pipeline__microbatches': 2,
    'train__grad_accum': 2,
    'train__shard_optimizer': True,
  },
  '1-2-4-sp-accum4': {
    'mesh__pp': 2,
    'mesh__tp': 4,
    'pipeline__microbatches': 2,
    'train__grad_accum': 4,
    'train__sequence_parallel': 'true',
  },
  '2-2-2-1f1b-zero1': {
    'mesh__dp': 2,
    'mesh__pp': 2,
    'mesh__tp': 2,
    'pipeline__microbatches': 4,
    'pipeline__schedule': '1f1b',
    'train__shard_optimizer': True,
  },
}


@pytest.mark.parametrize(
  'name',
  [pytest.param(n, marks=() if n in ('2-2-2-accum2', '8-1-1-zero1') else pytest.mark.slow) for n in WEIGHTED],
)
def test_weighted_loss_and_gradients_equal_one_device(name, weighted_reference):
  _check_against(weighted_reference, WEIGHTED[name])


def test_weighted_loss_is_the_weighted_mean_and_masked_targets_get_no_gradient():
  """The step's loss is sum(w * CE) / sum(w) of the whole batch (from the one-device logits), and
  the targets of weight-0 slots can change without changing the loss or any gradient."""
  cfg = small_cfg()
  s = setup_for(cfg)
  b = weighted_batches(1)[0]
  params = step_lib.make_init(s)(0)['params']

  def fn(p, bt):
    with sharding.use_rules(s.rules):
      doc = {k: bt[k] for k in loss_lib.DOC_KEYS if k in bt}
      return loss_lib.logits(p, bt['inputs'], s, doc=doc), loss_lib.loss_and_grads(p, bt, None, s)[:2]

  grad = step_lib.MeshJit(fn, s.mesh)
  logits, (loss, g) = grad(params, b)
  logits = np.asarray(logits)[..., : cfg.model.vocab_size].astype(np.float64)
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  ce = lse - np.take_along_axis(logits, b['targets'][..., None], -1)[..., 0]
  want = float((ce * b['weights']).sum() / b['weights'].sum())
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  other = dict(b, targets=np.where(b['weights'] == 0, (b['targets'] + 7) % VOCAB, b['targets']))
  assert (other['targets'] != b['targets']).any()
  _, (loss2, g2) = grad(params, other)
  assert float(loss2) == float(loss)
  chex.assert_trees_all_close(g2, g, rtol=0, atol=0)


# --- against transformers ---------------------------------------------------------------------------
HF_ROWS = 8


def _hf_setup(tmp_path, layout, **over):
  """A tiny random transformers Llama (untied) saved under tmp_path, imported onto `layout`."""
  from hf_helpers import imported, make_hf_model

  model = make_hf_model(str(tmp_path), tied=False)
  s, params = imported(
    str(tmp_path), layout, **{'train.global_batch_size': HF_ROWS, 'pipeline.microbatches': 2, **over}
  )
  return model, s, params


def _torch_doc_logits(model, inputs, positions):
  import torch

  ids = torch.as_tensor(np.asarray(inputs, np.int64))[None]
  pos = torch.as_tensor(np.asarray(positions, np.int64))[None]
  return model(input_ids=ids, position_ids=pos).logits[0]


@pytest.mark.slow
@pytest.mark.parametrize('layout', [(1, 1, 1), (2, 2, 2)])
def test_positions_reach_rotary(tmp_path, layout):
  """Rows of one document whose positions have gaps (rotary depends on position differences, so
  only positions that are not 0, 1, 2, ... tell the batch's from the slot index) equal transformers
  run at those position_ids."""
  import torch
  from hf_helpers import SEQ, TINY

  model, s, params = _hf_setup(tmp_path, layout)
  rng = np.random.default_rng(3)
  toks = rng.integers(0, TINY['vocab_size'], (HF_ROWS, SEQ)).astype(np.int32)
  pos = np.cumsum(rng.integers(1, 4, (HF_ROWS, SEQ)), axis=1).astype(np.int32) - 1
  doc = {'segment_ids': np.ones_like(toks), 'positions': pos}

  def fn(p, t, d):
    with sharding.use_rules(s.rules):
      return loss_lib.logits(p, t, s, doc=d)

  got = np.asarray(step_lib.MeshJit(fn, s.mesh)(params, toks, doc))[..., : TINY['vocab_size']]
  with torch.no_grad():
    want = np.stack([_torch_doc_logits(model, toks[r], pos[r]).numpy() for r in range(HF_ROWS)])
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def chat_rows(n_batches: int, seq: int, vocab: int, seed: int = 4) -> list[dict[str, np.ndarray]]:
  """Batches of HF_ROWS packed rows (data.packing=pack) of chat-like documents: a prompt of weight 0
  then an answer of weight 1; some documents longer than a row (cut)."""
  rng = np.random.default_rng(seed)
  sizes = rng.integers(4, seq + 6, 6 * HF_ROWS * n_batches)
  starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
  toks = rng.integers(0, vocab, starts[-1])
  w = np.zeros(starts[-1], np.uint8)
  for a, b in zip(starts[:-1], starts[1:], strict=True):
    w[a + int(rng.integers(1, b - a)) : b] = 1  # the answer: the document's tail
  lay = packing.layout(packing.Documents(toks, starts, w), seq, 'pack')
  assert lay.n_rows >= HF_ROWS * n_batches and lay.cut > 0
  return [lay.rows(np.arange(i * HF_ROWS, (i + 1) * HF_ROWS)) for i in range(n_batches)]


@pytest.mark.parametrize(
  'layout,over',
  [
    ((2, 2, 2), {}),
    pytest.param((1, 1, 1), {}, marks=pytest.mark.slow),
    pytest.param(
      (1, 2, 4), {'train.sequence_parallel': 'true', 'train.grad_accum': 2}, marks=pytest.mark.slow
    ),
    pytest.param(
      (2, 2, 2), {'pipeline.schedule': '1f1b', 'train.shard_optimizer': True}, marks=pytest.mark.slow
    ),
  ],
  ids=['2-2-2', '1-1-1', '1-2-4-sp-accum2', '2-2-2-1f1b-zero1'],
)
def test_finetune_on_packed_rows_equals_transformers_per_document(tmp_path, layout, over):
  """3 AdamW steps on packed chat rows equal transformers + torch.optim.AdamW run on each document
  alone at its positions with the same weights (loss sum(w * CE) / sum(w) of the batch): losses
  and gradient norms within 1e-4."""
  import torch
  from hf_helpers import SEQ, TINY

  from jax3d import assemble

  hp = {'train.lr': 3e-3, 'train.warmup_steps': 0, 'train.min_lr_ratio': 1.0, 'train.grad_clip': 0.0}
  model, s, params = _hf_setup(tmp_path, layout, **hp, **{'train.weight_decay': 0.1, **over})
  batches = chat_rows(3, SEQ, TINY['vocab_size'])
  state = step_lib.make_init_from_params(s)(params)
  train = assemble.compile_train_step(s)
  got = []
  for b in batches:
    state, m = train(state, {k: jax.device_put(v, s.batch_sharding) for k, v in b.items()})
    got.append((float(m['loss']), float(m['grad_norm'])))

  model.train()
  named = list(model.named_parameters())
  decay = [p for n, p in named if not n.endswith('norm.weight')]
  plain = [p for n, p in named if n.endswith('norm.weight')]
  t = s.cfg.train
  opt = torch.optim.AdamW(
    [{'params': decay, 'weight_decay': t.weight_decay}, {'params': plain, 'weight_decay': 0.0}],
    lr=t.lr,
    betas=(t.b1, t.b2),
    eps=1e-8,
  )
  want = []
  for b in batches:
    opt.zero_grad()
    total = 0.0
    for r in range(HF_ROWS):
      for seg in range(1, int(b['segment_ids'][r].max()) + 1):
        at = b['segment_ids'][r] == seg
        logits = _torch_doc_logits(model, b['inputs'][r][at], b['positions'][r][at])
        ce = torch.nn.functional.cross_entropy(
          logits, torch.as_tensor(b['targets'][r][at].astype(np.int64)), reduction='none'
        )
        total = total + (ce * torch.as_tensor(b['weights'][r][at])).sum()
    loss = total / float(b['weights'].sum())
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))
    want.append((float(loss.detach()), float(norm.detach())))
    opt.step()
  np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4)
