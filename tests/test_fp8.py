"""FP8 matmuls (train.matmul_dtype=fp8, jax3d/model/fp8.py): the custom VJP's forward and gradients
against a NumPy model of FP8 (ml_dtypes' float8 casts) and against the exact product within FP8's
error bound; a short CPU training within a stated tolerance of bf16's; on the deviceless H100
compile every projection of the layer an FP8 cuBLASLt GEMM (forward, dgrad, wgrad), the head not;
refused on an A100 and beside an int8 LoRA base."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_gpu_compile import needs_plugin

from jax3d import inspect as inspect_cmd
from jax3d.model import fp8

from helpers import fixed_batches, run_steps, small_cfg

DIMS = (((1,), (0,)), ((), ()))  # x [r, d] . w [d, k, h]: a projection with two output axes


def np_quantize(a: np.ndarray, fmt) -> np.ndarray:
  """a through `fmt` with a per-tensor scale amax / max(fmt), back in float32 (NumPy, ml_dtypes)."""
  scale = np.float32(np.abs(a).max() / float(ml_dtypes.finfo(fmt).max))
  return (a / scale).astype(fmt).astype(np.float32) * scale


def operands(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((64, 128)).astype(np.float32) * rng.uniform(0.1, 4, 128).astype(np.float32)
  w = rng.standard_normal((128, 3, 32)).astype(np.float32) * 0.05
  g = rng.standard_normal((64, 3, 32)).astype(np.float32) * 1e-3
  return x, w, g, (jnp.asarray(a, dtype) for a in (x, w, g))


def test_fp8_dot_is_e4m3_forward_and_e5m2_gradients():
  """In float32 (no compute-dtype rounding) the forward is the product of the E4M3-quantized
  operands, and dgrad and wgrad are the products with the E5M2-quantized gradient, to 1e-5
  (NumPy's casts, not jax's). Against the exact products: relative error (Frobenius) under
  2^-4 forward (E4M3's unit roundoff) and 2^-3 backward (E5M2's), and above 1e-3: quantized."""
  x, w, g, (jx, jw, jg) = operands()
  y, vjp = jax.vjp(lambda a, b: fp8.dot_general(a, b, DIMS), jx, jw)
  dx, dw = vjp(jg)
  xq, wq = np_quantize(x, ml_dtypes.float8_e4m3fn), np_quantize(w, ml_dtypes.float8_e4m3fn)
  gq = np_quantize(g, ml_dtypes.float8_e5m2)
  want = {
    'y': np.einsum('rd,dkh->rkh', xq, wq),
    'dx': np.einsum('rkh,dkh->rd', gq, wq),
    'dw': np.einsum('rd,rkh->dkh', xq, gq),
  }
  exact = {
    'y': np.einsum('rd,dkh->rkh', x, w),
    'dx': np.einsum('rkh,dkh->rd', g, w),
    'dw': np.einsum('rd,rkh->dkh', x, g),
  }
  got = {'y': y, 'dx': dx, 'dw': dw}
  for k, bound in (('y', 2**-4), ('dx', 2**-3), ('dw', 2**-3)):
    np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-5, atol=1e-5 * np.abs(want[k]).max())
    rel = np.linalg.norm(np.asarray(got[k]) - exact[k]) / np.linalg.norm(exact[k])
    assert 1e-3 < rel < bound, (k, rel)


def test_fp8_dot_in_bf16_and_at_the_edges():
  """bf16 operands (the compute dtype of a real run): bf16 out, within E4M3's bound of the exact
  product; all-zero operands give zeros (scale 1), and values far past 448 neither overflow nor
  give NaN (clipped to the format after the scale's rounding)."""
  x, w, _, (jx, jw, _) = operands(jnp.bfloat16)
  y = fp8.dot_general(jx, jw, DIMS)
  exact = np.einsum('rd,dkh->rkh', x, w)
  assert y.dtype == jnp.bfloat16
  assert np.linalg.norm(np.asarray(y, np.float32) - exact) / np.linalg.norm(exact) < 2**-4
  assert not np.any(np.asarray(fp8.dot_general(jnp.zeros_like(jx), jw, DIMS), np.float32))
  big = fp8.dot_general(jx * 1e4, jw, DIMS)
  big = np.asarray(big, np.float32)
  assert np.all(np.isfinite(big)) and np.linalg.norm(big - exact * 1e4) / np.linalg.norm(exact * 1e4) < 2**-4


def test_fp8_training_stays_within_tolerance_of_bf16():
  """6 steps of a 2-layer model in bf16 (2 batches seen 3 times) with the projections in FP8, on
  CPU (emulated): every loss within 0.2% (relative) of the bf16 run's (measured: 0.04%); the first
  step's gradients of every layer weight within 15% (Frobenius, relative; measured 6-9%: E5M2's
  unit roundoff is 12.5%) and at least 1% away from bf16's (FP8 acts in every projection)."""
  over = dict(model__n_layers=2, train__compute_dtype='bfloat16')
  batches = fixed_batches(small_cfg(**over), 2) * 3
  ref_losses, ref_grads, _ = run_steps(small_cfg(**over), batches=batches)
  losses, grads, _ = run_steps(small_cfg(**over, train__matmul_dtype='fp8'), batches=batches)
  assert ref_losses[-1] < ref_losses[0] - 0.3, ref_losses
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-3)
  rel = jax.tree.map(lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b)), grads, ref_grads)
  assert max(jax.tree.leaves(rel)) < 0.15, rel
  assert min(rel['layers'][p]['kernel'] for p in ('qkv', 'o', 'gate_up', 'down')) > 1e-2, rel


def test_fp8_with_an_int8_base_is_refused():
  from jax3d import config as config_lib
  from jax3d.errors import ConfigError

  cfg = small_cfg(lora__rank=4, lora__base_dtype='int8', train__matmul_dtype='fp8')
  with pytest.raises(ConfigError, match="train.matmul_dtype='fp8'.*lora.base_dtype='int8'"):
    config_lib.validate(cfg, 1)


PROJECTIONS = ('Block._qkv/qkv/', 'Block._attention_out/o/', 'Block._mlp/gate_up/', 'Block._mlp/down/')


@needs_plugin
@pytest.mark.slow  # 15-20 s: one compile for 8 x H100 (CPU tests above guard the feature by default)
def test_every_projection_is_an_fp8_cublaslt_gemm_on_h100():
  """The tiny model (bf16, 2 layers, dp=4 x tp=2) compiled for 8 x H100 with XLA's Triton GEMMs
  and the loop's double buffering off (one layer per loop body): in the layer loop each of the four
  projections (q, k, v fused; o; gate, up fused; down) is one `__cublas$lt$matmul$f8` forward and
  two backward (dgrad, wgrad): 12 per layer; the head's three GEMMs stay bf16 cuBLASLt ones. The same
  step without fp8 has no FP8 GEMM and the same 15."""
  import re

  from jax3d import assemble, config as config_lib
  from jax3d.devices import gpu_target

  def gemms(**over):
    ov = {'train.compute_dtype': 'bfloat16', 'model.n_layers': 2, 'train.global_batch_size': 16}
    ov |= {'mesh.dp': 4, 'mesh.pp': 1, 'mesh.tp': 2, 'pipeline.microbatches': 1, **over}
    s = assemble.build(config_lib.load_config('tiny', ov), gpu_target.devices(gpu_target.parse('h100x8')))
    opts = gpu_target.compiler_options() | {
      'xla_gpu_enable_triton_gemm': False,
      'xla_gpu_enable_while_loop_double_buffering': False,
    }
    text = assemble.compile_train_step(s, opts).executable.as_text()
    out = []
    for line in text.splitlines():
      call = re.search(r'custom_call_target="(__cublas\$lt\$matmul[^"]*)"', line)
      if call:
        name = re.search(r'op_name="([^"]*)"', line).group(1)
        where = next((p.split('/')[1] for p in PROJECTIONS if p in name), 'head' if 'Head' in name else name)
        out.append((call.group(1), where, 'bwd' if 'transpose(' in name else 'fwd'))
    return sorted(out)

  f8, lt = '__cublas$lt$matmul$f8', '__cublas$lt$matmul'
  want = [(f8, p, d) for p in ('qkv', 'o', 'gate_up', 'down') for d in ('fwd', 'bwd', 'bwd')]
  want += [(lt, 'head', 'fwd'), (lt, 'head', 'bwd'), (lt, 'head', 'bwd')]
  assert gemms(**{'train.matmul_dtype': 'fp8'}) == sorted(want)
  assert gemms() == sorted((lt, p, d) for _, p, d in want)


@needs_plugin
def test_fp8_on_an_a100_is_one_error_line(capsys):
  """An A100 (compute capability 8.0) has no FP8 tensor cores: exit 2 and one line naming the
  setting, its value, the GPU and what is valid, before anything compiles."""
  assert inspect_cmd.main(['--target=a100x8', '--config.train.matmul_dtype=fp8', '--json']) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith('error: '), err
  for words in ("train.matmul_dtype='fp8'", 'NVIDIA A100-SXM4-80GB (compute capability 8)', '8.9', "''"):
    assert words in err[0], (words, err[0])


def test_fp8_run_says_so_and_keeps_sequence_parallelism_off():
  """The start-up line names the FP8 matmuls (and a bf16 run's does not); with tp=2,
  train.sequence_parallel=auto resolves off beside fp8 (on without it), and `true` is refused."""
  from jax3d import config as config_lib
  from jax3d.errors import ConfigError
  from jax3d.trainer import metrics

  from helpers import setup_for

  over = dict(model__n_layers=2, train__compute_dtype='bfloat16', mesh__tp=2, train__sequence_parallel='auto')
  line = lambda s: next(x for x in metrics.summary_lines(s, '') if 'parameters per device' in x)
  s8, s16 = setup_for(small_cfg(**over, train__matmul_dtype='fp8')), setup_for(small_cfg(**over))
  assert 'compute bfloat16 (projection matmuls in fp8: E4M3 forward, E5M2 gradients)' in line(s8)
  assert 'fp8' not in line(s16)
  assert not s8.plan.sequence_parallel and s16.plan.sequence_parallel
  cfg = small_cfg(**{**over, 'train__sequence_parallel': 'true'}, train__matmul_dtype='fp8')
  with pytest.raises(ConfigError, match="train.sequence_parallel='true'.*false or auto"):
    config_lib.validate(cfg, 2)
