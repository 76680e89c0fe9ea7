"""LoRA dropout (lora.dropout, PEFT's lora_dropout; jax3d/model/lora.py): the masks come from global
coordinates, so every layout and micro-batch split trains like one device; the adapter with a given
mask equals torch's lora_B(lora_A(dropout(x))) * alpha/r, values and gradients; evaluation has none."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from test_lora import LORA, reference as no_dropout, run_lora, with_nonzero_b

from jax3d import step as step_lib
from jax3d.model import lora

from helpers import fixed_batches, setup_for, small_cfg

DROP = {**LORA, 'lora__dropout': 0.1}
_REF = {}


def reference():
  if 'one' not in _REF:
    _REF['one'] = run_lora(small_cfg(**DROP))
  return _REF['one']


@pytest.mark.parametrize(
  'over',
  [
    pytest.param(  # 20-50 s: the default suite keeps the mask's own tests (-m slow runs the layouts)
      {'mesh__dp': 2, 'mesh__pp': 2, 'mesh__tp': 2, 'pipeline__microbatches': 2}, marks=pytest.mark.slow
    ),
    pytest.param(
      {'mesh__pp': 2, 'mesh__tp': 4, 'pipeline__microbatches': 2, 'train__sequence_parallel': 'true'},
      marks=pytest.mark.slow,
    ),
    pytest.param(
      {'mesh__dp': 2, 'mesh__pp': 2, 'mesh__tp': 2, 'pipeline__microbatches': 2, 'train__grad_accum': 2},
      marks=pytest.mark.slow,
    ),
    pytest.param(
      {
        'mesh__dp': 2,
        'mesh__pp': 2,
        'mesh__tp': 2,
        'pipeline__microbatches': 2,
        'pipeline__schedule': '1f1b',
        'train__shard_optimizer': True,
      },
      marks=pytest.mark.slow,
    ),
    pytest.param({'mesh__dp': 2, 'mesh__cp': 4}, marks=pytest.mark.slow),
  ],
  ids=['2-2-2-m2', '1-2-4-sp', '2-2-2-accum2', '2-2-2-1f1b-zero1', 'dp2-cp4'],
)
def test_dropout_layouts_equal_one_device(over):
  losses, grads, _, _ = run_lora(small_cfg(**DROP, **over))
  r_losses, r_grads, _, _ = reference()
  np.testing.assert_allclose(losses, r_losses, rtol=1e-5)
  chex.assert_trees_all_close(grads, r_grads, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # default-suite budget (CI runs -m slow too)
def test_training_drops_and_evaluation_does_not():
  """The first step's training loss (dropout 0.1) differs from the held-out loss of the same
  parameters on the same batch (no dropout in evaluation), and from one without dropout."""
  s = setup_for(small_cfg(**DROP))
  params = with_nonzero_b(s, step_lib.make_init(s)(s.cfg.train.seed)['params'])
  b = {k: jax.device_put(v, s.batch_sharding) for k, v in fixed_batches(s.cfg, 1)[0].items()}
  held_out = float(step_lib.make_eval_step(s)(params, b))
  assert abs(reference()[0][0] - held_out) > 1e-5
  assert abs(no_dropout()[0][0] - held_out) < 1e-6 * held_out  # (the same parameters: B from seed 1)


def test_evaluation_step_has_no_dropout():
  """The default suite's guard of the above (a few seconds): the eval step's loss with lora.dropout
  0.5 equals the one without dropout, on the same parameters (B non-zero) and batch."""
  small = {**LORA, 'model__n_layers': 2, 'train__global_batch_size': 4}
  setups = [setup_for(small_cfg(**small, lora__dropout=p)) for p in (0.0, 0.5)]
  params = with_nonzero_b(setups[0], step_lib.make_init(setups[0])(0)['params'])  # the same layout
  b = {k: jax.device_put(v, setups[0].batch_sharding) for k, v in fixed_batches(setups[0].cfg, 1)[0].items()}
  losses = [float(step_lib.make_eval_step(s)(params, b)) for s in setups]
  assert losses[1] == pytest.approx(losses[0], rel=1e-6)


def test_mask_keeps_one_minus_p_independently():
  """keep_mask keeps a fraction 1 - p of the entries (4-sigma binomial band), the masks of two
  adapters of a layer, of two layers, and of two steps are uncorrelated, and the same inputs give
  the same mask."""
  p, rows, feats = 0.3, 4096, 64
  words = lora.noise_words(0, jnp.int32(5), (rows // 64, 64)).reshape(rows)
  salt = lora.layer_salt({'qkv': {'kernel': jnp.arange(12.0)}})
  masks = [
    lora.keep_mask(words, lora.target_salt(salt, 0), (feats,), p),
    lora.keep_mask(words, lora.target_salt(salt, 1), (feats,), p),
    lora.keep_mask(
      words, lora.target_salt(lora.layer_salt({'qkv': {'k': jnp.arange(1.0, 13)}}), 0), (feats,), p
    ),
    lora.keep_mask(lora.noise_words(0, jnp.int32(6), (rows,)), lora.target_salt(salt, 0), (feats,), p),
  ]
  n = rows * feats
  for m in masks:
    assert abs(float(m.mean()) - (1 - p)) < 4 * np.sqrt(p * (1 - p) / n)
  chex.assert_trees_all_equal(masks[0], lora.keep_mask(words, lora.target_salt(salt, 0), (feats,), p))
  a = np.asarray(masks[0], np.float32).ravel()
  for m in masks[1:]:
    assert abs(np.corrcoef(a, np.asarray(m, np.float32).ravel())[0, 1]) < 4 / np.sqrt(n)
  # E[x * keep / (1 - p)] = x: the scaling of inverted dropout
  x = np.asarray(masks[0], np.float32) / (1 - p)
  assert abs(x.mean() - 1) < 4 * np.sqrt(p / (1 - p) / n)


EPS32 = float(np.finfo(np.float32).eps)


def test_adapter_with_a_mask_equals_torch_lora_dropout_branch():
  """The adapter on x with dropout (p 0.25), the mask read back from keep_mask, against torch:
  lora_B(lora_A(x * mask / (1 - p))) * alpha/r, its value and the gradients of A, B and x."""
  p, r, scale, d_in, d_out = 0.25, 4, 2.0, 16, 12
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 8, d_in)).astype(np.float32)
  cot = rng.standard_normal((2, 8, d_out)).astype(np.float32)
  words = lora.noise_words(3, jnp.int32(1), (2, 8))
  salt = jnp.uint32(12345)
  ad = lora.Adapter(
    (d_in,), (d_out,), ('embed',), ('mlp',), r, scale, jnp.float32, jnp.float32, p, name='lora_q'
  )
  params = nn.unbox(ad.init(jax.random.key(0), x, ('batch', 'lora')))
  params = jax.tree.map(lambda a: a + 0.1 * rng.standard_normal(a.shape).astype(np.float32), params)

  def f(prm, x):
    return jnp.sum(ad.apply(prm, x, ('batch', 'lora'), (words, salt)) * cot)

  y = ad.apply(params, x, ('batch', 'lora'), (words, salt))
  g_p, g_x = jax.grad(f, argnums=(0, 1))(params, x)
  keep = np.asarray(lora.keep_mask(words, lora.target_salt(salt, 0), (d_in,), p))
  assert 0 < keep.mean() < 1
  a_t = torch.tensor(np.asarray(params['params']['a']).T.copy(), requires_grad=True)  # lora_A [r, in]
  b_t = torch.tensor(np.asarray(params['params']['b']).T.copy(), requires_grad=True)  # lora_B [out, r]
  x_t = torch.tensor(x, requires_grad=True)
  xd = x_t * torch.tensor(keep, dtype=torch.float32) / (1 - p)
  y_t = torch.nn.functional.linear(torch.nn.functional.linear(xd, a_t), b_t) * scale
  (y_t * torch.tensor(cot)).sum().backward()
  # fp32 on both sides, summed in different orders: an entry that is a sum of n products is off by
  # up to about n * eps times the size of its terms (not of the sum, which may cancel to near 0),
  # so the bound is n * eps32 relative to the array's largest entry, n the longest sum behind it:
  # y sums d_in*r products, dA rows*d_out, dB rows*d_in, dx r*d_out (rows = 2*8).
  n = {'y': d_in * r, 'a': 16 * d_out, 'b': 16 * d_in, 'x': r * d_out}
  fp32_close = lambda got, want, k: np.testing.assert_allclose(
    got, want, rtol=n[k] * EPS32, atol=n[k] * EPS32 * np.abs(want).max()
  )
  fp32_close(y, y_t.detach().numpy(), 'y')
  fp32_close(g_p['params']['a'], a_t.grad.numpy().T, 'a')
  fp32_close(g_p['params']['b'], b_t.grad.numpy().T, 'b')
  fp32_close(g_x, x_t.grad.numpy(), 'x')
  # without noise (evaluation) the adapter is the plain branch
  plain = (x @ np.asarray(params['params']['a']) @ np.asarray(params['params']['b'])) * scale
  fp32_close(ad.apply(params, x, ('batch', 'lora')), plain, 'y')


@pytest.mark.slow
def test_peft_adapter_dropout_is_read_written_and_off_in_evaluation(tmp_path):
  """A PEFT adapter saved with lora_dropout 0.1: jax3d takes lora.dropout from it (an explicit one
  overrides it; one outside [0, 1) is refused naming the entry), writes it back in its export's
  adapter_config.json, and its logits equal peft's in eval mode (torch's train mode drops)."""
  import json
  import shutil

  import hf_helpers as H
  from test_lora_peft import make_adapter

  from jax3d import assemble
  from jax3d.errors import ConfigError
  from jax3d.hf import peft as peft_io

  base, adapter = str(tmp_path / 'base'), str(tmp_path / 'adapter')
  H.make_hf_model(base, tied=False)
  pm = make_adapter(base, adapter, dropout=0.1)
  s, params = H.imported(base, (1, 1, 1), **{'lora.init_from': adapter})
  assert s.cfg.lora.dropout == 0.1 and s.dims.lora_dropout == 0.1
  assert peft_io.config_json(s, base)['lora_dropout'] == 0.1
  toks = H.tokens(3)
  ours = H.jax3d_logits(s, params, toks)
  assert H.rel_err(ours, H.hf_logits(pm.eval(), toks)) < 1e-4
  torch.manual_seed(0)
  assert H.rel_err(H.hf_logits(pm.train(), toks), ours) > 1e-4  # peft's dropout is on in training
  cfg = assemble.resolve(H.jax3d_cfg(base, (1, 1, 1), **{'lora.init_from': adapter, 'lora.dropout': 0.05}))
  assert cfg.lora.dropout == 0.05
  bad = str(tmp_path / 'bad')
  shutil.copytree(adapter, bad)
  with open(f'{bad}/{peft_io.CONFIG}') as f:
    c = json.load(f) | {'lora_dropout': 1.0}
  with open(f'{bad}/{peft_io.CONFIG}', 'w') as f:
    json.dump(c, f)
  with pytest.raises(ConfigError, match=r'lora_dropout=1.0; a number in \[0, 1\)'):
    assemble.resolve(H.jax3d_cfg(base, (1, 1, 1), **{'lora.init_from': bad}))
