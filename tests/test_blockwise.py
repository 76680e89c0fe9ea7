"""Blockwise attention (issue 42) equals XLA's dense attention, the reference, in numbers:

* the kernel alone: rows of many documents of uneven length (one-token ones among them) and
  padding, GQA 8/2, a Qwen3-like head size (128 with a smaller d_model), blocks smaller than
  the rows (so block skipping runs), queries shorter than the keys (a suffix of them); output and
  gradients of q, k, v within 1e-5 in float32, bf16 within its tolerance;
* the model: loss, gradients and logits of `auto` (blockwise on CPU) against `xla` on rows of
  documents, at 1-1-1 (default) and 2-2-2, 1-2-4 SP, 2-2-2 1F1B and ZeRO-3 (slow).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_documents import weighted_batches

from jax3d.model import attention, blockwise

from helpers import run_steps, small_cfg


def _segments(lengths: list[int], t: int) -> np.ndarray:
  """A row of documents of `lengths` in order, then padding (segment 0), as data.packing writes."""
  seg = np.zeros(t, np.int32)
  at = 0
  for i, n in enumerate(lengths, start=1):
    seg[at : at + n] = i
    at += n
  return seg


def _dense(q, k, v, q_pos, k_pos, seg_q, seg_k):
  """XLA's attention with the mask the rule gives: same segment, key position <= query position."""
  mask = (seg_q[:, :, None] == seg_k[:, None, :]) & (k_pos[:, None, :] <= q_pos[:, :, None])
  return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation='xla')


def _inputs(t, n, kv, h, dtype, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(2, t, n, h)), dtype)
  k, v = (jnp.asarray(rng.normal(size=(2, t, kv, h)), dtype) for _ in range(2))
  seg = jnp.asarray(np.stack([_segments([1, 9, 1, 1, 20, 3, 1, 14], t), _segments([30, 1, 2, t - 40], t)]))
  w = jnp.asarray(rng.normal(size=(2, t, n, h)), jnp.float32)
  return q, k, v, seg, w


@pytest.mark.parametrize(
  'n,kv,h,block', [(8, 2, 16, 16), (4, 2, 128, 8), pytest.param(8, 8, 16, 64, marks=pytest.mark.slow)]
)
def test_blockwise_equals_dense_attention(n, kv, h, block):
  t = 64
  q, k, v, seg, w = _inputs(t, n, kv, h, jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))

  def loss(fn):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), argnums=(0, 1, 2)))(q, k, v)

  ref = loss(
    lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, mask=attention.segment_mask(seg), is_causal=True, implementation='xla'
    )
  )
  got = loss(lambda q, k, v: blockwise.attention(q, k, v, pos, pos, seg, seg, block))
  chex.assert_trees_all_close(got, ref, rtol=1e-5, atol=1e-5)
  out = jax.jit(blockwise.attention, static_argnums=7)(q, k, v, pos, pos, seg, seg, block)
  np.testing.assert_allclose(out, _dense(q, k, v, pos, pos, seg, seg), rtol=1e-5, atol=1e-5)
  # one document, no segment ids: causal attention alone
  np.testing.assert_allclose(
    jax.jit(lambda q, k, v: blockwise.attention(q, k, v, pos, pos, block=block))(q, k, v),
    jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation='xla'),
    rtol=1e-5,
    atol=1e-5,
  )


def test_blockwise_queries_a_suffix_of_the_keys_in_another_order():
  """Queries and keys of different lengths, in a permuted order (what context parallelism passes):
  causality from the positions, not the array order."""
  t, n, kv, h = 64, 8, 2, 16
  q, k, v, seg, w = _inputs(t, n, kv, h, jnp.float32, seed=1)
  perm = jnp.asarray(np.random.default_rng(2).permutation(t))
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))
  kp, ks, kk, vv = pos[:, perm], seg[:, perm], k[:, perm], v[:, perm]
  qs = slice(24, None)
  args = (q[:, qs], kk, vv, pos[:, qs], kp, seg[:, qs], ks)

  def grads(fn):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v, *args[3:]) * w[:, qs])
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args[:3])

  got = grads(lambda *a: blockwise.attention(*a, block=16))
  chex.assert_trees_all_close(got, grads(_dense), rtol=1e-5, atol=1e-5)


def test_blockwise_bf16_within_tolerance():
  t, n, kv, h = 64, 8, 2, 16
  q, k, v, seg, _ = _inputs(t, n, kv, h, jnp.bfloat16)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  ref = _dense(*f32, pos, pos, seg, seg)
  got = jax.jit(blockwise.attention, static_argnums=7)(q, k, v, pos, pos, seg, seg, 16)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), ref, atol=2e-2)


MODEL = {'model__n_layers': 2, 'model__n_kv_heads': 2}
LAYOUTS = {
  '1-1-1': {},
  '2-2-2': {'mesh__dp': 2, 'mesh__pp': 2, 'mesh__tp': 2, 'pipeline__microbatches': 2},
  '1-2-4-sp': {
    'mesh__pp': 2,
    'mesh__tp': 4,
    'model__n_kv_heads': 4,
    'pipeline__microbatches': 2,
    'train__sequence_parallel': 'true',
  },
  '2-2-2-1f1b': {
    'mesh__dp': 2,
    'mesh__pp': 2,
    'mesh__tp': 2,
    'pipeline__microbatches': 4,
    'pipeline__schedule': '1f1b',
  },
  '8-1-1-zero3': {'mesh__dp': 8, 'train__shard_params': True},
}


@pytest.mark.parametrize(
  'name', [pytest.param(n, marks=() if n == '1-1-1' else pytest.mark.slow) for n in LAYOUTS]
)
def test_model_blockwise_equals_xla(name, monkeypatch):
  """Losses of 2 steps and step-1 gradients on rows of documents with padding: blockwise (blocks
  of 4 on rows of 16: several blocks, skipping) against XLA's dense attention."""
  monkeypatch.setattr(blockwise, 'BLOCK', 4)
  over = MODEL | LAYOUTS[name]
  batches = weighted_batches(2)
  got = run_steps(small_cfg(train__attention='blockwise', **over), batches=batches)
  ref = run_steps(small_cfg(train__attention='xla', **over), batches=batches)
  np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
  chex.assert_trees_all_close(got[1], ref[1], rtol=1e-5, atol=1e-6)


def test_memory_model_and_oom_ladder_price_the_kernel():
  """The layer's residuals as the memory model traces them: XLA's grow with seq^2 (the scores),
  blockwise's linearly; the OOM ladder offers the attention implementation for a config on `xla`."""
  from jax3d import config as config_lib
  from jax3d.planning import memory_model, oom

  res = lambda kernel, seq: memory_model.layer_residual_bytes(
    64, 4, 2, 128, seq, 1, policy='none', compute='float32', param='float32', flash=kernel, batch=1
  )
  growth = lambda k: (res(k, 2048) - res(k, 1024)) / (res(k, 1024) - res(k, 512))
  assert growth('blockwise') == pytest.approx(2, rel=1e-3)  # linear in seq
  assert growth('xla') > 3.5  # the scores' seq^2 dominates
  assert res('xla', 1024) - res('blockwise', 1024) > 4 * 1024 * 1024 * 4  # 4 heads of fp32 scores
  over = {'train.seq_len': 4096, 'model.max_seq_len': 4096, 'mesh.dp': 1, 'mesh.pp': 1, 'mesh.tp': 1}
  over |= {'pipeline.microbatches': 1}
  rungs = {}
  for kernel in ('xla', 'auto'):
    cfg = config_lib.load_config('tiny', over | {'train.attention': kernel})
    lines = oom.oom_ladder(cfg, config_lib.validate(cfg, 1), 1e8)
    rungs[kernel] = [x for x in lines if x.startswith('2b. attention implementation')]
  assert not rungs['auto']
  assert 'train.attention=auto: blockwise' in rungs['xla'][0] and 'saves' in rungs['xla'][0]
  # the GPU kernels that take documents (pallas, auto's fused) are priced as blockwise: no bias
  from jax3d.planning import costmodel

  cfg = config_lib.load_config('tiny', over)
  plan = config_lib.validate(cfg, 1)
  acts = lambda k: costmodel.estimate(cfg, plan, hw=costmodel.Hardware(attention=k)).breakdown['activations']
  assert acts('pallas') == acts('fused') == acts('blockwise') < acts('xla')
