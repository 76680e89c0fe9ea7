"""The counting formulas (jax3d/model/formulas.py) against the real model and against each other:
the parameter count is the parameters `init_params` creates, and the planner, the trainer and the
inspector compute MFU from the same model FLOPs per token."""

import jax
import numpy as np
import pytest

from jax3d import config as config_lib
from jax3d.model import formulas, llama as model_lib
from jax3d.planning import costmodel

GQA = model_lib.Dims(
  n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=100, vocab_padded=128
)


class H100:
  platform, device_kind = 'gpu', 'NVIDIA H100 80GB HBM3'


class Cpu:
  platform, device_kind = 'cpu', 'cpu'


def test_param_count_is_the_real_model():
  """The formulas count what init_params creates (GQA: fewer K/V heads), padded vocab rows excluded."""
  params = model_lib.init_params(jax.random.key(0), GQA, np.arange(GQA.n_layers))
  size = lambda tree: sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree))
  padded_rows = 2 * (GQA.vocab_padded - GQA.vocab_size) * GQA.d_model  # embedding and head
  assert formulas.param_count(GQA) == size(params) - padded_rows == GQA.param_count()
  assert formulas.layer_params(GQA) * GQA.n_layers == size(params['layers'])
  assert formulas.embed_head_params(GQA, padded=True) == size(params['embed']) + size(params['head'])


def test_hand_count():
  # per layer: 2 norms 2*64, q,o 2*64*64, k,v 2*64*32 (2 kv heads of 16), mlp 3*64*128
  per_layer = 128 + 8192 + 4096 + 24576
  assert formulas.layer_params(GQA) == per_layer
  assert formulas.layer_params(GQA, tp=2) == (per_layer - 128) // 2 + 128  # norms are not split
  p_all = 2 * per_layer + 2 * 100 * 64 + 64
  assert formulas.param_count(GQA) == p_all
  p = p_all - 100 * 64  # the input embedding is a lookup: not in 6P
  per_token = 6 * p + 12 * 2 * 64 * 32  # seq_len 32
  assert formulas.flops_per_token(GQA, 32) == per_token
  assert formulas.stage_forward_flops(GQA, 1, 1000) == 2 * per_layer * 1000
  # 1e6 tokens/s on 4 devices of 100 TFLOP/s
  assert formulas.mfu(1e6, per_token, 100e12, 4) == pytest.approx(1e6 * per_token / 4e14)
  assert formulas.peak_flops(H100()) == 989e12
  assert formulas.peak_flops(Cpu()) is None  # no invented CPU peak
  assert formulas.peak_flops(Cpu(), override_tflops=2.0) == 2e12
  assert formulas.MFUMeter(GQA, 32, Cpu(), 8)(1e6) is None


def test_dims_from_config_without_a_plan():
  cfg = config_lib.load_config('tiny', {'model.vocab_size': 300, 'model.vocab_multiple': 128})
  plan = config_lib.validate(cfg, 8)
  assert model_lib.Dims.from_config(cfg) == model_lib.Dims.from_config(cfg, plan)
  assert config_lib.padded_vocab(cfg.model) == plan.vocab_padded == 384
  assert costmodel.param_count(cfg) == formulas.param_count(model_lib.Dims.from_config(cfg))


@pytest.mark.parametrize('overrides', [{}, {'model.n_kv_heads': 4, 'train.remat': 'full'}])
def test_planner_trainer_and_inspector_agree_on_mfu(overrides):
  """For the same tokens/s and peak, the planner's MFU (costmodel.Estimate) is the trainer's
  (formulas.MFUMeter), and the inspector's model FLOPs per device per step use the same per-token
  count: 6P + 12Lhs with P without the input embedding, everywhere."""
  cfg = config_lib.load_config('tiny', overrides)
  plan = config_lib.validate(cfg, 8)
  dims = model_lib.Dims.from_config(cfg, plan)
  hw = costmodel.Hardware(peak_tflops=100.0, flash_attention=False)
  est = costmodel.estimate(cfg, plan, hw=hw)
  meter = formulas.MFUMeter(dims, cfg.train.seq_len, H100(), plan.n_devices, hw.peak_tflops)
  assert est.model_flops_per_token == meter.per_token == formulas.flops_per_token(dims, plan.seq_len)
  assert est.mfu == pytest.approx(meter(est.tokens_per_s), rel=1e-12)
  # Recomputed from the planner's tokens/s: its MFU is model FLOPs over peak FLOPs.
  assert est.mfu == pytest.approx(est.tokens_per_s * meter.per_token / (100e12 * plan.n_devices), rel=1e-12)
  inspector = formulas.flops_per_token(dims, plan.seq_len) * plan.tokens_per_step / plan.n_devices
  assert inspector == pytest.approx(
    est.model_flops_per_token * plan.tokens_per_step / plan.n_devices, rel=1e-12
  )
