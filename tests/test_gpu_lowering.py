"""The GPU path lowered without a GPU (issue 35): the train step of a 2x2x2 layout exported for the
CUDA platform (`jax.export`, bf16 compute) under each schedule and sharding option, and the lowered
module checked for what the GPU run relies on: the explicit collectives on the mesh axis each
belongs to (pipeline sends over pp, the written-out gradient sums over dp), the donated train state
(every state buffer aliased to an output), and bf16 matmuls. No `gpu` marker: it runs on the CPU.

Attention is lowered with XLA's implementation: `jax.export` on CPU devices has no GPU to pick
cuDNN for. tests/test_gpu_compile.py compiles the step for GPU devices (cuDNN attention
included) with XLA:GPU itself; scripts/bench_gpu.py runs it when a GPU is lent."""

import re

import jax
import numpy as np
import pytest
from test_checkpoint import cfg_for

from jax3d import assemble, step as step_lib
from jax3d.errors import ConfigError
from jax3d.model import attention


def export_cuda(**over):
  """(the Setup, the StableHLO text of its train step exported for 'cuda')."""
  cfg = cfg_for(2, 2, 2, m=2, **{'train__compute_dtype': 'bfloat16', 'train__attention': 'xla', **over})
  s = assemble.build(cfg)
  with jax.set_mesh(s.mesh):
    exp = jax.export.export(step_lib.make_train_step(s).jitted, platforms=['cuda'])(
      s.abstract_state, s.abstract_batch
    )
  assert exp.platforms == ('cuda',)
  return s, exp.mlir_module()


def axis_groups(s, axis):
  """The replica groups of a collective over one mesh axis, as the module writes them (logical
  device ids in mesh order)."""
  ids = np.arange(s.mesh.devices.size).reshape(s.mesh.devices.shape)
  k = s.mesh.axis_names.index(axis)
  return sorted(map(list, np.moveaxis(ids, k, -1).reshape(-1, ids.shape[k]).tolist()))


def collectives_by_axis(s, text):
  """{axis: {collective op names over exactly that axis}} from the module's replica groups."""
  out = {a: set() for a in s.mesh.axis_names}
  for op, groups in re.findall(
    r'"?stablehlo\.(all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute)"?\((?:.|\n)*?'
    r'(?:replica_groups|source_target_pairs) = dense<(\[\[[\d, \[\]]*\]\])>',
    text,
  ):
    pairs = sorted(map(sorted, eval(groups)))  # noqa: S307 - a literal list of ints from the module
    for a in s.mesh.axis_names:
      full = axis_groups(s, a)
      if pairs == full or all(any(set(p) <= set(g) for g in full) for p in pairs):
        out[a].add(op)
        break
  return out


def check_module(s, text, expect):
  by_axis = collectives_by_axis(s, text)
  for axis, ops in expect.items():
    assert ops <= by_axis[axis], (axis, ops, by_axis)
  # The donated state: one aliased output per state buffer (none held twice on the GPU).
  assert text.count('tf.aliasing_output') + text.count('jax.buffer_donor') == len(
    jax.tree.leaves(s.abstract_state)
  ), 'donation lost'
  dots = re.findall(r'stablehlo\.dot_general .*?: \(tensor<(?:\d+x)*(\w+)>', text)
  assert dots.count('bf16') >= 6, dots


CASES = {
  'gpipe': ({}, {'pp': {'collective_permute'}}),
  'circular sp zero1 int8': (
    {
      'pipeline__schedule': 'circular',
      'pipeline__repeats': 2,
      'train__sequence_parallel': 'true',
      'train__shard_optimizer': True,
      'train__grad_reduce_dtype': 'int8',
    },
    # ZeRO-1 keeps the int8 sum's shard: no all-gather of it over dp
    {'pp': {'collective_permute'}, 'dp': {'all_to_all'}, 'tp': {'all_gather', 'reduce_scatter'}},
  ),
  'circular': ({'pipeline__schedule': 'circular', 'pipeline__repeats': 2}, {'pp': {'collective_permute'}}),
  'sequence parallel': (
    {'train__sequence_parallel': 'true'},
    {'pp': {'collective_permute'}, 'tp': {'all_gather', 'reduce_scatter'}},
  ),
  'zero1': ({'train__shard_optimizer': True}, {'dp': {'reduce_scatter'}}),
  'int8': ({'train__grad_reduce_dtype': 'int8'}, {'dp': {'all_to_all', 'all_gather'}}),
  'bf16 reduce': ({'train__grad_reduce_dtype': 'bfloat16'}, {'dp': {'all_to_all'}}),
}


@pytest.mark.parametrize('name', list(CASES))  # about 1 s each
def test_train_step_lowers_for_cuda(name):
  over, expect = CASES[name]
  s, text = export_cuda(**over)
  check_module(s, text, expect)


def test_attention_kernel_resolved_for_the_devices(monkeypatch):
  """`auto` is `fused` (cuDNN / Pallas) only where cuDNN runs (GPU, bf16/fp16, a head size it
  takes), blockwise elsewhere; `cudnn` or `pallas` where it cannot run is a config error naming the
  setting (tests/test_gpu_compile.py compiles them for GPUs)."""
  cpu = jax.devices('cpu')
  assert attention.resolve('auto', cpu, 'bfloat16', 64) == 'blockwise'
  assert attention.resolve('blockwise', cpu, 'float32', 64) == 'blockwise'
  assert attention.resolve('xla', cpu, 'bfloat16', 64) == 'xla'
  with pytest.raises(ConfigError, match=r"train.attention='cudnn' cannot run here: it needs NVIDIA GPUs"):
    attention.resolve('cudnn', cpu, 'bfloat16', 64)
  with pytest.raises(ConfigError, match=r"train.attention='pallas' cannot run here: it needs NVIDIA GPUs"):
    attention.resolve('pallas', cpu, 'float32', 64)
  assert attention.cudnn_supported('gpu', 'bfloat16', 128, 9.0) == ''
  assert attention.cudnn_supported('gpu', 'bfloat16', 256, 9.0) == ''
  assert 'at most 128' in attention.cudnn_supported('gpu', 'bfloat16', 256, 8.0)
  assert 'multiple of 8' in attention.cudnn_supported('gpu', 'float16', 60, 9.0)
  assert 'train.compute_dtype=float32' in attention.cudnn_supported('gpu', 'float32', 64, 9.0)
  monkeypatch.setattr(attention, 'device_facts', lambda devices: ('gpu', 9.0))
  assert attention.resolve('auto', cpu, 'bfloat16', 128) == 'fused'
  assert attention.resolve('auto', cpu, 'float32', 128) == 'blockwise'
  assert attention.resolve('pallas', cpu, 'float32', 64) == 'pallas'
