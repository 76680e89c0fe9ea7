"""Every layout gives the one-device numbers: first 3 losses and step-1 gradients, rtol 1e-5."""

import functools

import chex
import numpy as np
import pytest

from helpers import run_steps, small_cfg

RTOL, ATOL = 1e-5, 1e-7


@functools.cache
def reference(**key):
  return run_steps(small_cfg(**dict(key)))


def ref(**over):
  return reference(**over)


def check(cfg_over, ref_over=()):
  losses, grads, params = run_steps(small_cfg(**cfg_over))
  r_losses, r_grads, r_params = reference(**dict(ref_over))
  chex.assert_trees_all_close(params, r_params, rtol=0, atol=0)  # init is layout-independent
  np.testing.assert_allclose(losses, r_losses, rtol=RTOL)
  chex.assert_trees_all_close(grads, r_grads, rtol=RTOL, atol=ATOL)
  assert losses[2] < losses[0]  # the steps really train


@pytest.mark.parametrize('dp,tp', [(8, 1), (4, 2), (2, 4), (1, 8)])
def test_data_and_tensor_parallel_equal_one_device(dp, tp):
  check({'mesh__dp': dp, 'mesh__tp': tp})


@pytest.mark.parametrize('dp,pp,tp', [(1, 8, 1), (2, 2, 2), (1, 2, 4), (2, 4, 1), (4, 2, 1), (1, 4, 2)])
@pytest.mark.parametrize('m_per_p', [1, 2])
def test_3d_layouts_equal_one_device(dp, pp, tp, m_per_p):
  check({'mesh__dp': dp, 'mesh__pp': pp, 'mesh__tp': tp, 'pipeline__microbatches': m_per_p * pp})


@pytest.mark.parametrize('policy', ['none', 'full', 'dots', 'attn'])
def test_remat_policies_equal_one_device(policy):
  check({'mesh__dp': 2, 'mesh__pp': 2, 'mesh__tp': 2, 'pipeline__microbatches': 4, 'train__remat': policy})


def test_circular_schedule_equals_one_device():
  check(
    {
      'mesh__dp': 2,
      'mesh__pp': 2,
      'mesh__tp': 2,
      'pipeline__microbatches': 2,
      'pipeline__repeats': 2,
      'pipeline__schedule': 'circular',
    }
  )


def test_grad_accum_equals_full_batch():
  check({'mesh__dp': 2, 'mesh__pp': 2, 'mesh__tp': 2, 'pipeline__microbatches': 2, 'train__grad_accum': 2})


def test_gqa_and_bf16_params_run_under_tp():
  """GQA (8 query heads over 2 KV heads) under tp=2 equals its one-device run."""
  check(
    {'mesh__dp': 2, 'mesh__pp': 2, 'mesh__tp': 2, 'pipeline__microbatches': 2, 'model__n_kv_heads': 2},
    (('model__n_kv_heads', 2),),
  )
