"""Hugging Face Llama tensors <-> jax3d's parameter layout, in both directions.

jax3d (jax3d/model/llama.py) stores, per stacked layer (axis 0 in pipeline storage order,
`placement.layer_order`): qkv [d, k, g+2, h] (per KV head: its g query heads, then K, then V),
o [n, h, d], gate_up [d, 2, f], down [f, d], attn_norm / mlp_norm [d]; embed [v_padded, d], head
norm [d] and out [d, v_padded]. Hugging Face stores nn.Linear weights [out, in]: q_proj [n*h, d]
(query head i = rows i*h.., and it uses KV head i // g, as here), k_proj / v_proj [k*h, d],
o_proj [d, n*h], gate_proj / up_proj [f, d], down_proj [d, f]. Both use the half-split rotary
form, so no permutation of the head dimension is needed.

Import (`load_params`): every parameter is assembled in its target sharding from its devices'
blocks: each distinct block (a tuple of slices into the jax3d array) is mapped to the blocks of
the Hugging Face tensors it needs, read from the safetensors files (only those), laid out, put on
every device that holds it, and dropped: the host holds one device's block at a time, never a
whole tensor of the model, let alone the model.

Export (`hf_tensors`): the Hugging Face tensors in checkpoint order, each with a function that
fetches it from the (sharded) jax3d parameters, one tensor (one layer's slice) at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jax3d.hf import experts, peft, safetensors_io
from jax3d.hf.config import HFModel
from jax3d.model import llama, lora, quant

if TYPE_CHECKING:
  from jax3d.setup import Setup


def _bounds(sl: slice, n: int) -> tuple[int, int]:
  start, stop, _ = sl.indices(n)
  return start, stop


class _Blocks:
  """The block of each jax3d parameter at a device's index, read from the checkpoint."""

  def __init__(self, hf: HFModel, setup: Setup):
    self.hf, self.dims, self.reader = hf, setup.dims, safetensors_io.Reader()
    self.order = setup.layer_order

  def read(self, name: str, *index: slice) -> np.ndarray:
    return self.reader.read(self.hf.tensors[name][0], name, *index).astype(np.float32)

  def vocab_rows(self, name: str, sv: slice, sd: slice) -> np.ndarray:
    """Rows sv of a [v, d] tensor in the padded vocabulary (rows past the real vocabulary: 0)."""
    v0, v1 = _bounds(sv, self.dims.vocab_padded)
    real = self.read(name, slice(v0, max(v0, min(v1, self.dims.vocab_size))), sd)
    return np.concatenate([real, np.zeros((v1 - v0 - real.shape[0], real.shape[1]), np.float32)])

  def layer(self, leaf: str, i: int, idx: tuple[slice, ...]) -> np.ndarray:
    """The block idx of canonical layer i's parameter `leaf` (e.g. 'qkv/kernel')."""
    dm, p = self.dims, f'model.layers.{i}.'
    d, h, k, f, n = dm.d_model, dm.head_dim, dm.n_kv_heads, dm.d_ff, dm.n_heads
    g = n // k
    if leaf == 'attn_norm/scale':
      return self.read(p + 'input_layernorm.weight', idx[0])
    if leaf in ('q_norm/scale', 'k_norm/scale'):
      return self.read(p + f'self_attn.{leaf[0]}_norm.weight', idx[0])
    if leaf == 'qkv/bias':
      sk, sc, sh = idx
      k0, k1 = _bounds(sk, k)
      q = self.read(p + 'self_attn.q_proj.bias', slice(k0 * g * h, k1 * g * h)).reshape(k1 - k0, g, h)
      kv = [
        self.read(p + f'self_attn.{x}_proj.bias', slice(k0 * h, k1 * h)).reshape(k1 - k0, 1, h) for x in 'kv'
      ]
      return np.concatenate([q] + kv, 1)[:, sc, sh]
    if leaf == 'mlp_norm/scale':
      return self.read(p + 'post_attention_layernorm.weight', idx[0])
    if leaf == 'qkv/kernel':
      sd, sk, sc, sh = idx
      k0, k1 = _bounds(sk, k)
      q = self.read(p + 'self_attn.q_proj.weight', slice(k0 * g * h, k1 * g * h), sd)
      dd = q.shape[1]
      kv = [self.read(p + f'self_attn.{x}_proj.weight', slice(k0 * h, k1 * h), sd) for x in 'kv']
      qkv_kchd = np.concatenate(
        [q.reshape(k1 - k0, g, h, dd)] + [x.reshape(k1 - k0, 1, h, dd) for x in kv], 1
      )
      return qkv_kchd[:, sc, sh, :].transpose(3, 0, 1, 2)
    if leaf == 'o/kernel':
      sn, sh, sd = idx
      n0, n1 = _bounds(sn, n)
      o_dnh = self.read(p + 'self_attn.o_proj.weight', sd, slice(n0 * h, n1 * h)).reshape(-1, n1 - n0, h)
      return o_dnh[:, :, sh].transpose(1, 2, 0)
    if leaf == 'gate_up/kernel':
      sd, s2, sf = idx
      gu_2fd = np.stack([self.read(p + f'mlp.{x}_proj.weight', sf, sd) for x in ('gate', 'up')])
      return gu_2fd[s2].transpose(2, 0, 1)
    if leaf == 'down/kernel':
      sf, sd = idx
      return self.read(p + 'mlp.down_proj.weight', sd, sf).T
    if leaf.startswith('moe/'):
      return experts.read_block(self.hf, self.dims, self.read, leaf, i, idx)
    raise KeyError(f'no Hugging Face tensor for layers/{leaf} (d={d}, f={f})')

  def block(self, path: tuple[str, ...], idx: tuple[slice, ...]) -> np.ndarray:
    """The block idx of the jax3d parameter at `path` (('layers', 'qkv', 'kernel'), ...)."""
    if path[0] == 'layers':
      j0, j1 = _bounds(idx[0], len(self.order))
      leaf = '/'.join(path[1:])
      return np.stack([self.layer(leaf, int(self.order[j]), idx[1:]) for j in range(j0, j1)])
    if path == ('embed', 'embedding'):
      return self.vocab_rows('model.embed_tokens.weight', *idx)
    if path == ('head', 'norm', 'scale'):
      return self.read('model.norm.weight', idx[0])
    if path == ('head', llama.STATS_PROBE):  # the router statistics' probe: zero, not a weight
      return np.zeros(np.arange(self.dims.n_experts + 3)[idx[0]].shape, np.float32)
    if path == ('head', 'out', 'kernel'):  # untied only: a tied head is the embedding
      sd, sv = idx
      return self.vocab_rows('lm_head.weight', sv, sd).T
    raise KeyError(f'no Hugging Face tensor for {"/".join(path)}')


def _keys(path: tuple) -> tuple[str, ...]:
  return tuple(str(getattr(k, 'key', k)) for k in path)


def load_params(setup: Setup) -> Any:
  """The weights of the Hugging Face folder setup was built from (`setup.hf`, read once by
  assemble.build) as jax3d parameters, each created in its target sharding from the blocks its
  devices hold (see the module docstring), in setup's pipeline layer order and dtype. With LoRA,
  the adapters too: lora.init_from's PEFT folder, or fresh ones from train.seed."""
  params = load_base(setup)
  if setup.dims.lora_rank == 0:
    return params
  return lora.merge(params, _adapters(setup, lora.trainable(setup.dims, setup.abstract_state['params'])[0]))


def load_base(setup: Setup) -> Any:
  """`load_params` without the LoRA adapters (the frozen base; all of it without LoRA)."""
  if setup.hf is None:
    raise ValueError('load_params: the setup was not built from an hf: import (checkpoint.init_from)')
  blocks = _Blocks(setup.hf, setup)

  abstract, scales = lora.split(setup.abstract_state['params'], True)[1], {}

  def make(path: tuple, a: jax.ShapeDtypeStruct) -> jax.Array | None:
    keys = _keys(path)
    if keys[-1] == quant.SCALE:  # an int8 base's scale: made with its kernel
      return None
    if a.dtype != np.int8:
      return load(keys, a)
    # an int8 base's kernel: read in float32 and quantized leaf by leaf (one float kernel at a time)
    scale_sh = abstract['layers'][keys[1]][quant.SCALE].sharding
    q_fn = functools.partial(quant.quantize_kernel, n_in=quant.IN_AXES[keys[1]])
    w = load(keys, jax.ShapeDtypeStruct(a.shape, np.float32, sharding=a.sharding))
    q, scales[keys[1]] = jax.jit(q_fn, out_shardings=(a.sharding, scale_sh))(w)
    return q

  def load(keys: tuple[str, ...], a: jax.ShapeDtypeStruct) -> jax.Array:
    # Each distinct block is read once and put on every device that holds it before the next is
    # read, so the host holds one block at a time (make_array_from_callback would build all of a
    # process's blocks first, all of a stacked kernel's at once).
    by_block = {}
    for d, idx in a.sharding.addressable_devices_indices_map(a.shape).items():
      key = tuple((s.start, s.stop, s.step) for s in idx)
      by_block.setdefault(key, (idx, []))[1].append(d)
    shards = []
    for idx, devices in by_block.values():
      block = np.asarray(blocks.block(keys, tuple(idx)), dtype=a.dtype)
      shards += [jax.device_put(block, d) for d in devices]
      del block
    return jax.make_array_from_single_device_arrays(a.shape, a.sharding, shards)

  base = jax.tree_util.tree_map_with_path(make, abstract)
  for name, scale in scales.items():
    base['layers'][name][quant.SCALE] = scale
  return base


def _adapters(setup: Setup, abstract: Any) -> Any:
  """The LoRA adapters over an imported base: lora.init_from's PEFT folder, or fresh ones from
  train.seed (those of a run initialised from the seed: B zero, so the model is the base's)."""
  if setup.cfg.lora.init_from:
    return peft.load(setup.cfg.lora.init_from, setup, abstract)
  dims, order = setup.dims, setup.layer_order
  init = lambda: lora.trainable(dims, llama.init_params(jax.random.key(setup.cfg.train.seed), dims, order))[0]
  return jax.jit(init, out_shardings=jax.tree.map(lambda a: a.sharding, abstract))()


# --- export ----------------------------------------------------------------------------------
Fetch = Callable[[], np.ndarray]


def hf_tensors(
  params: Any, setup: Setup, fused: bool = False
) -> Iterator[tuple[str, tuple[int, ...], np.dtype, Fetch]]:
  """(name, shape, dtype, fetch) of every Hugging Face tensor of the model (no lm_head when tied),
  where fetch() gathers one layer's slice of one parameter to the host (single-process runs); a
  mixture's experts one tensor per expert, or with `fused` transformers 5's fused tensors."""
  dm = setup.dims
  d, h, k, n, v = dm.d_model, dm.head_dim, dm.n_kv_heads, dm.n_heads, dm.vocab_size
  g, dtype = n // k, np.dtype(dm.param_dtype)
  position = np.argsort(setup.layer_order)  # canonical layer i is stored at position[i]
  get = lambda a: np.asarray(jax.device_get(a), np.float32)
  lay = lambda leaf, i, kind=None: get(
    params['layers'][leaf][kind or ('kernel' if 'norm' not in leaf else 'scale')][position[i]]
  )
  yield 'model.embed_tokens.weight', (v, d), dtype, lambda: get(params['embed']['embedding'][:v])
  for i in range(dm.n_layers):
    p = f'model.layers.{i}.'
    qkv = lambda i=i: lay('qkv', i)  # [d, k, g+2, h]
    yield p + 'input_layernorm.weight', (d,), dtype, lambda i=i: lay('attn_norm', i)
    yield p + 'self_attn.q_proj.weight', (n * h, d), dtype, lambda q=qkv: q()[:, :, :g].reshape(d, n * h).T
    yield p + 'self_attn.k_proj.weight', (k * h, d), dtype, lambda q=qkv: q()[:, :, g].reshape(d, k * h).T
    yield p + 'self_attn.v_proj.weight', (k * h, d), dtype, lambda q=qkv: q()[:, :, g + 1].reshape(d, k * h).T
    if dm.qkv_bias:
      bias = lambda i=i: lay('qkv', i, 'bias')  # [k, g+2, h]
      yield p + 'self_attn.q_proj.bias', (n * h,), dtype, lambda b=bias: b()[:, :g].reshape(n * h)
      yield p + 'self_attn.k_proj.bias', (k * h,), dtype, lambda b=bias: b()[:, g].reshape(k * h)
      yield p + 'self_attn.v_proj.bias', (k * h,), dtype, lambda b=bias: b()[:, g + 1].reshape(k * h)
    if dm.qk_norm:
      yield p + 'self_attn.q_norm.weight', (h,), dtype, lambda i=i: lay('q_norm', i)
      yield p + 'self_attn.k_norm.weight', (h,), dtype, lambda i=i: lay('k_norm', i)
    yield p + 'self_attn.o_proj.weight', (d, n * h), dtype, lambda i=i: lay('o', i).reshape(n * h, d).T
    yield p + 'post_attention_layernorm.weight', (d,), dtype, lambda i=i: lay('mlp_norm', i)
    if dm.n_experts:
      yield from experts.hf_tensors(params, setup, i, position[i], fused)
      continue
    yield p + 'mlp.gate_proj.weight', (dm.d_ff, d), dtype, lambda i=i: lay('gate_up', i)[:, 0].T
    yield p + 'mlp.up_proj.weight', (dm.d_ff, d), dtype, lambda i=i: lay('gate_up', i)[:, 1].T
    yield p + 'mlp.down_proj.weight', (d, dm.d_ff), dtype, lambda i=i: lay('down', i).T
  yield 'model.norm.weight', (d,), dtype, lambda: get(params['head']['norm']['scale'])
  if not dm.tie_embeddings:
    yield 'lm_head.weight', (v, d), dtype, lambda: get(params['head']['out']['kernel'][:, :v]).T
