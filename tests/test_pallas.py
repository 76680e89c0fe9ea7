"""`train.attention=pallas` and `auto`'s `fused` on GPUs (issue 42): JAX's Pallas Triton flash
attention with the documents' segment ids, equal to XLA's dense attention, the reference.

On CPU the kernel runs in Pallas's interpreter (jax3d/model/pallas.py picks it by platform; users
cannot reach it there: `resolve` refuses `pallas` off GPUs), through the same per-device regions
and custom VJP as on a GPU:
* the kernel alone: rows of documents of uneven length (one-token ones among them) and padding,
  GQA 8/2, a row length that is not a whole block (padded inside); the output within 1e-5 in
  float32 on one device (default: the interpreter compiles slowly), and (slow) the output and the
  gradients of q, k, v on a 2x1x2 mesh with rows over dp and heads over tp, with and without
  segment ids, and at Qwen3's head size;
* the model's layer (slow) with `pallas` and `fused` (auto's on GPUs), on dp 2 x tp 2: its loss
  and the gradients of its parameters and input against `xla`.
With the CUDA plugin (slow): the GPU program holds the Triton kernel and no [t, t] array, `fused`
without segment ids is cuDNN's kernel without a bias, and the kernel's blocks fit an A100's shared
memory at head size 256 (bf16) and 128 (float32).
"""

import dataclasses
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_blockwise import _segments
from test_documents import weighted_batches

from jax3d.devices import gpu_target
from jax3d.model import attention, llama, pallas
from jax3d.parallel import sharding

from helpers import setup_for, small_cfg


def _inputs(t, n, kv, h, b=4, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((b, t, kv, h)), jnp.float32) for _ in range(2))
  rows = [[1, 5, 1, 1, 8, 1, 3], [12, 1, 2, t - 18], [t], [5, 1, 1, 1, 12]]
  seg = jnp.asarray(np.stack([_segments(rows[i % 4], t) for i in range(b)]))
  w = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
  return q, k, v, seg, w


def _out_and_grads(kernel, q, k, v, seg, w, mesh=None):
  """The attention's output and the gradients of q, k, v for the cotangent w."""

  def fn(q, k, v):
    out, vjp = jax.vjp(lambda q, k, v: attention.attend(q, k, v, seg, kernel), q, k, v)
    return out, vjp(w)

  if mesh is None:
    return jax.jit(fn)(q, k, v)
  with jax.set_mesh(mesh), sharding.use_rules(sharding.logical_rules('dp')):
    return jax.jit(fn)(q, k, v)


def test_pallas_forward_equals_xla():
  """The default suite's case (the interpreter compiles slowly: the backward is under -m slow):
  the output alone, one device, documents with padding, GQA 8/2, 24 tokens padded to a block."""
  q, k, v, seg, _ = _inputs(24, 8, 2, 16, b=2)
  got = jax.jit(lambda q, k, v: attention.attend(q, k, v, seg, 'pallas'))(q, k, v)
  ref = attention.attend(q, k, v, seg, 'xla')
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


class _CountingKernel:
  """pallas_attention.mha with its calls counted: the forward (`mha(...)`, `mha.fwd`) and backward."""

  def __init__(self, real):
    self.real, self.calls = real, {'forward': 0, 'fwd': 0, 'bwd': 0}

  def __call__(self, *a, **kw):
    self.calls['forward'] += 1
    return self.real(*a, **kw)

  def fwd(self, *a, **kw):
    self.calls['fwd'] += 1
    return self.real.fwd(*a, **kw)

  def bwd(self, *a, **kw):
    self.calls['bwd'] += 1
    return self.real.bwd(*a, **kw)


def test_backward_takes_the_forwards_logsumexp(monkeypatch):
  """The gradient's program runs the kernel's forward once (returning the logsumexp it keeps) and
  its backward rule on it, never the forward again for the backward (8B on 8 H100s: 256 forward
  calls per step instead of 384, scripts/bench_vs_maxtext_gpu.py). Traced, not compiled."""
  kernel = _CountingKernel(pallas._mha())
  monkeypatch.setattr(pallas, '_mha', lambda: kernel)
  q, k, v, seg, _ = _inputs(24, 8, 2, 16, b=2)
  loss = lambda q, k, v: attention.attend(q, k, v, seg, 'pallas').sum()
  jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(q, k, v)
  # each count per platform branch (Triton and the interpreter are both traced)
  assert kernel.calls['fwd'] == 0 and kernel.calls['bwd'] == kernel.calls['forward'] > 0, kernel.calls


@pytest.mark.slow
@pytest.mark.parametrize('segments,h', [(True, 16), (False, 16), (True, 128)])
def test_pallas_equals_xla_per_device(segments, h):
  """Output and gradients, on a 2x1x2 mesh (rows over dp, heads over tp: the per-device regions);
  h 128 is Qwen3's head size."""
  q, k, v, seg, w = _inputs(40, 8, 2, h, b=2)  # 40 tokens: padded to a block of 64 inside
  seg = seg if segments else None
  mesh = jax.make_mesh((2, 1, 2), ('dp', 'pp', 'tp'), axis_types=(jax.sharding.AxisType.Auto,) * 3)
  got = _out_and_grads('pallas', q, k, v, seg, w, mesh)
  chex.assert_trees_all_close(got, _out_and_grads('xla', q, k, v, seg, w), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize('kernel', ['pallas', 'fused'])
def test_layer_equals_xla_on_documents(kernel, monkeypatch):
  """The model's layer (QKV, RoPE, the attention, its output, the MLP) with `pallas`, or `fused`
  (auto's on GPUs: Pallas on rows of documents), on packed rows of documents with padding (GQA
  8/2, dp 2 x tp 2: rows and heads split per device): the loss and the gradients of the layer's
  parameters and input against `xla`, float32. (Not the whole train step on CPU: inside the
  pipeline's shard_map, Pallas's interpreter in jax 0.10 fails on the manual axes' types; the GPU
  compile of every layout is in tests/test_gpu_compile.py.)"""
  monkeypatch.setattr(attention, 'device_facts', lambda devices: ('gpu', 9.0))  # `pallas` resolves
  cfg = small_cfg(model__n_layers=1, model__n_kv_heads=2, mesh__dp=2, mesh__tp=2, mesh__pp=1)
  s = setup_for(cfg)
  init = lambda kernel: llama.init_params(
    jax.random.key(0), dataclasses.replace(s.dims, attention=kernel), s.layer_order
  )
  with jax.set_mesh(s.mesh), sharding.use_rules(s.rules):  # as make_init: jitted, the kernel's dims, the mesh
    params, params_xla = (jax.jit(functools.partial(init, k))() for k in (kernel, 'xla'))
  chex.assert_trees_all_equal(params, params_xla)  # the dummy-token trace is XLA's whatever the kernel
  layer = jax.tree.map(lambda a: a[0], params['layers'])
  rows = weighted_batches(1)[0]
  seg, pos = jnp.asarray(rows['segment_ids']), jnp.asarray(rows['positions'])
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((*seg.shape, s.dims.d_model)), jnp.float32)
  w = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

  def value_and_grads(kernel):
    dims = dataclasses.replace(s.dims, attention=kernel)
    loss = lambda p, x: jnp.sum(llama.block_apply(dims, p, x, pos, segment_ids=seg) * w)
    with jax.set_mesh(s.mesh), sharding.use_rules(s.rules):
      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(layer, x)

  seen = []
  real = pallas.attention_lse
  monkeypatch.setattr(pallas, 'attention_lse', lambda *a: seen.append(1) or real(*a))
  got = value_and_grads(kernel)
  assert seen  # Pallas ran
  ref = value_and_grads('xla')
  np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
  chex.assert_trees_all_close(got[1], ref[1], rtol=1e-5, atol=1e-5)


needs_plugin = pytest.mark.skipif(not gpu_target.plugin_installed(), reason="needs JAX's CUDA plugin")


@needs_plugin
@pytest.mark.slow
def test_gpu_program_of_fused_attention():
  """Compiled for one H100 (no GPU): with documents, the Triton kernel (forward and backward) and
  no array of [t, t]; without (rows of one document), cuDNN's kernel and no bias."""
  dev = gpu_target.devices(gpu_target.parse('h100x1'))[0]
  sh = jax.sharding.SingleDeviceSharding(dev)
  b, t, n, kv, h = 2, 1024, 8, 2, 64
  spec = lambda heads: jax.ShapeDtypeStruct((b, t, heads, h), jnp.bfloat16, sharding=sh)
  seg = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=sh)

  def program(*args):
    loss = lambda q, k, v, *s: attention.attend(q, k, v, *(s or (None,)), 'fused').astype(jnp.float32).sum()
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return fn.lower(*args).compile(gpu_target.compiler_options()).as_text()

  text = program(spec(n), spec(kv), spec(kv), seg)
  calls = re.findall(r'custom_call_target="([^"]*)"', text)
  # the forward once and the backward's two kernels (dK/dV, dQ) from its logsumexp: no second forward
  assert calls.count('__gpu$xla.gpu.triton') == 3 and not any('cudnn' in c for c in calls), calls
  assert not re.search(rf'\b{t},{t}\]', text)
  calls = set(re.findall(r'custom_call_target="([^"]*)"', program(spec(n), spec(kv), spec(kv))))
  assert calls == {'__cudnn$fmhaSoftmax', '__cudnn$fmhaSoftmaxBackward'}
  # blocks that fit the smaller shared memory of an A100 (164 KiB) at large heads and in float32
  sh = jax.sharding.SingleDeviceSharding(gpu_target.devices(gpu_target.parse('a100x1'))[0])
  for dtype, h in ((jnp.bfloat16, 256), (jnp.float32, 128)):
    q, k = (jax.ShapeDtypeStruct((b, t, heads, h), dtype, sharding=sh) for heads in (n, kv))
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=sh)
    step = lambda q, k, v, s: pallas.backward(q, k, v, s, *pallas.attention_lse(q, k, v, s), q)
    jax.jit(step).lower(q, k, k, seg).compile(gpu_target.compiler_options())  # or RESOURCE_EXHAUSTED
