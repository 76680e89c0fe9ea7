"""LoRA over an int8 base (lora.base_dtype=int8, jax3d/model/quant.py): the kernels int8 with a scale
per output channel, within half a quantization step of the original; training equal on every
layout, the base bit for bit frozen; the planner's bytes the built state's; --merge dequantizes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_lora import D222, LORA, _local_bytes, run_lora

from jax3d.model import llama, lora, quant
from jax3d.model.dims import Dims

from helpers import canonical, setup_for, small_cfg

I8 = {**LORA, 'lora__base_dtype': 'int8'}
_REF = {}


def reference():
  if 'one' not in _REF:
    _REF['one'] = run_lora(small_cfg(**I8))
  return _REF['one']


@pytest.mark.slow  # default-suite budget (CI runs -m slow too)
def test_quantized_kernels_are_within_half_a_step_of_the_original():
  """Every projection: |W - q s| <= s / 2 per entry, q in [-127, 127], s = max|W| / 127 over the
  input features of each output channel (a whole-zero channel: scale 1, q 0); so is the model's
  own int8 init against its float32 init, whose other base weights it holds in bfloat16."""
  rng = np.random.default_rng(0)
  for name, n_in in quant.IN_AXES.items():
    shape = (3, 16, 4, 5) if n_in == 2 else (3, 16, 6)
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 3, shape[-1])
    w[1, ..., 0] = 0
    q, s = quant.quantize_kernel(jnp.asarray(w), n_in)
    assert q.dtype == jnp.int8 and s.shape == (3, *shape[1 + n_in :])
    assert int(jnp.abs(q.astype(jnp.int32)).max()) <= 127
    axes = tuple(range(1, 1 + n_in))
    np.testing.assert_allclose(s, np.where(np.abs(w).max(axes) > 0, np.abs(w).max(axes) / 127, 1), rtol=1e-6)
    back = np.asarray(quant.dequantize_kernel(q, s, n_in, jnp.float32, True))
    bound = np.expand_dims(np.asarray(s), axes) / 2
    assert np.all(np.abs(back - w) <= bound * (1 + 1e-6)), name
  p8, pb = (lora.split(init(dims(base_dtype=t)), True)[1] for t in ('int8', 'float32'))
  for name, n_in in quant.IN_AXES.items():
    w, q, sc = pb['layers'][name]['kernel'], p8['layers'][name]['kernel'], p8['layers'][name][quant.SCALE]
    axes = tuple(range(1, 1 + n_in))
    w = np.asarray(w, np.float32)
    np.testing.assert_allclose(sc, np.abs(w).max(axes) / 127, rtol=1e-6)
    back = np.asarray(quant.dequantize_kernel(q, sc, n_in, jnp.float32, True))
    assert np.all(np.abs(back - w) <= np.expand_dims(sc, axes) / 2 * (1 + 1e-5)), name
  assert p8['layers']['attn_norm']['scale'].dtype == jnp.bfloat16
  np.testing.assert_array_equal(p8['embed']['embedding'], pb['embed']['embedding'].astype(jnp.bfloat16))


def dims(**over):
  """The model of the small LoRA config with lora.* `over` (no mesh: one device's layer order)."""
  return Dims.from_config(small_cfg(**LORA, **{f'lora__{k}': v for k, v in over.items()}))


def init(d):
  """The seed-0 parameters of the model `d`, on the host."""
  return jax.device_get(jax.jit(lambda: llama.init_params(jax.random.key(0), d, np.arange(d.n_layers)))())


@pytest.mark.parametrize(
  'over',
  [
    pytest.param(D222, marks=pytest.mark.slow),  # the default suite trains int8 on one device (below)
    pytest.param(
      {'mesh__pp': 2, 'mesh__tp': 4, 'pipeline__microbatches': 2, 'train__sequence_parallel': 'true'},
      marks=pytest.mark.slow,
    ),
    pytest.param({**D222, 'train__shard_params': True, 'train__remat': 'full'}, marks=pytest.mark.slow),
    pytest.param({**D222, 'train__shard_optimizer': True, 'train__remat': 'stage'}, marks=pytest.mark.slow),
  ],
  ids=['2-2-2-m2', '1-2-4-sp', '2-2-2-zero3-remat-full', '2-2-2-zero1-remat-stage'],
)
def test_int8_base_layouts_equal_one_device(over):
  losses, grads, base0, base1 = run_lora(small_cfg(**I8, **over))
  r_losses, r_grads, r_base0, _ = reference()
  assert base0['layers']['qkv']['kernel'].dtype == np.int8
  chex.assert_trees_all_equal(base0, r_base0)  # quantized the same on every layout
  chex.assert_trees_all_equal(base1, base0)  # frozen: bit for bit
  np.testing.assert_allclose(losses, r_losses, rtol=1e-5)
  chex.assert_trees_all_close(grads, r_grads, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # 11-16 s (default-suite budget; CI runs -m slow)
def test_int8_base_trains_like_its_float32_base():
  """3 steps over the int8 quantization of the float32 initialisation: losses within 1e-4
  (relative) of the float32 base's, the adapters' first gradients within 1%."""
  r_losses, r_grads, base0, base1 = reference()
  assert base0['layers']['qkv']['kernel'].dtype == np.int8
  chex.assert_trees_all_equal(base1, base0)  # frozen: bit for bit
  losses, grads, _, _ = run_lora(small_cfg(**LORA, lora__base_dtype='float32'))
  np.testing.assert_allclose(r_losses, losses, rtol=1e-4)
  rel = jax.tree.map(lambda a, b: float(np.abs(a - b).max() / np.abs(b).max()), r_grads, grads)
  assert max(jax.tree.leaves(rel)) < 1e-2


@pytest.mark.parametrize('over', [D222, {**D222, 'train__shard_params': True}], ids=['2-2-2', 'zero3'])
def test_planner_prices_the_int8_base_as_built(over):
  from jax3d.planning import memory_model

  s = setup_for(small_cfg(**I8, **over))
  b = memory_model.breakdown(s.cfg, s.plan, flash=False)
  assert b['params'] == pytest.approx(_local_bytes(s.abstract_state['params']), rel=1e-6)
  bf16 = setup_for(small_cfg(**LORA, **over, lora__base_dtype='bfloat16'))
  assert b['params'] < 0.75 * memory_model.breakdown(bf16.cfg, bf16.plan, flash=False)['params']


def test_merge_dequantizes():
  """lora.merged (export --merge) of an int8 base: each kernel dequantize(q, s) + B A alpha/r in
  the base's float dtype, no scales left."""
  d = dims(base_dtype='int8')
  rng = np.random.default_rng(2)
  params = init(d)
  params['layers'] = {
    k: ({**v, 'b': rng.standard_normal(v['b'].shape).astype(np.float32)} if k.startswith('lora_') else v)
    for k, v in params['layers'].items()
  }
  merged = jax.jit(lambda p: lora.merged(d, p))(params)
  assert (
    quant.SCALE not in merged['layers']['down'] and merged['layers']['down']['kernel'].dtype == jnp.bfloat16
  )
  q, sc = params['layers']['down']['kernel'], params['layers']['down'][quant.SCALE]
  a, b = params['layers']['lora_down']['a'], params['layers']['lora_down']['b']
  want = q.astype(np.float32) * sc[:, None, :] + np.einsum('lir,lro->lio', a, b) * d.lora_scale
  np.testing.assert_allclose(
    np.asarray(merged['layers']['down']['kernel'], np.float32), want, rtol=2e-2, atol=1e-2
  )


@pytest.mark.slow
def test_hf_import_quantizes_each_kernel_within_half_a_step(tmp_path):
  """An hf: import on 1-2-2 with lora.base_dtype=int8: each kernel dequantized is within half a
  step of the Hugging Face weights (read back through the float32 import's layout), and the logits
  stay within 2% of the float32 import's."""
  import hf_helpers as H

  base = str(tmp_path / 'base')
  H.make_hf_model(base, tied=False)
  over = {'lora.rank': 4, 'lora.alpha': 8.0}
  s8, p8 = H.imported(base, (1, 2, 2), **over, **{'lora.base_dtype': 'int8'})
  s32, p32 = H.imported(base, (1, 2, 2), **over, **{'lora.base_dtype': 'float32'})
  c8, c32 = canonical(s8, p8)['layers'], canonical(s32, p32)['layers']
  for name, n_in in quant.IN_AXES.items():
    assert c8[name]['kernel'].dtype == np.int8
    axes = tuple(range(1, 1 + n_in))
    back = np.asarray(
      quant.dequantize_kernel(c8[name]['kernel'], c8[name][quant.SCALE], n_in, jnp.float32, True)
    )
    bound = np.expand_dims(c8[name][quant.SCALE], axes) / 2 * (1 + 1e-5)
    assert np.all(np.abs(back - c32[name]['kernel']) <= bound), name
  toks = H.tokens(1)
  assert H.rel_err(H.jax3d_logits(s8, p8, toks), H.jax3d_logits(s32, p32, toks)) < 2e-2
