"""Generation: `python -m jax3d.sample` from a checkpoint on another layout, and the KV cache.

The KV-cache decoder (generate.py) runs the training model's own layer (model.Block) through its
KV-cache path: one token at a time, attention over the cached keys and values. It is checked here
against the training path of the same layer (the one the loss uses), recomputed over the whole
growing sequence for every new token: same logits, same greedy tokens. The checkpoint is trained
with a tiny learning rate so that greedy decoding still produces varied bytes (a model trained a
few steps at full rate predicts ' ' everywhere, which would hide a wrong cache or a wrong layer
order).
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax3d
from jax3d import sample as sample_lib
from jax3d.model import generate as gen_lib, llama as model_lib
from jax3d.parallel import placement
from jax3d.trainer import workdir as sampling

from helpers import cached_logits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = {
  'model.d_model': 64,
  'model.d_ff': 128,
  'model.max_seq_len': 64,
  'train.seq_len': 32,
  'train.global_batch_size': 16,
  'train.steps': 3,
  'train.warmup_steps': 1,
  'train.lr': 1e-4,
  'log.every': 1,
  'eval.every': 0,
  'eval.batches': 1,
  'checkpoint.every': 0,
}
PROMPT = 'def '


def _cli(*args, **env_extra):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}  # the CLI makes its own 8 devices
  env.update(
    **env_extra,
    JAX_PLATFORMS='cpu',
    PYTHONIOENCODING='utf-8',
    PYTHONPATH=os.pathsep.join([ROOT, env.get('PYTHONPATH', '')]),
  )
  return subprocess.run(
    [sys.executable, '-m', 'jax3d.sample', *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    timeout=600,
    check=False,
  )


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """A 3-step run of the small model in a workdir (layout dp=2 pp=2 tp=2, m=4), checkpointed."""
  workdir = str(tmp_path_factory.mktemp('run'))
  t = jax3d.build(jax3d.load_config('tiny', SMALL), workdir=workdir)
  records = t.train()
  t.close()
  assert [r['step'] for r in records if 'loss' in r] == [1, 2, 3]
  return t, workdir


def _reference_greedy(dims, params, layout, prompt, n):
  """Greedy decoding by recomputing the training forward pass over the whole sequence for every
  token: embed -> every model.Block in canonical order -> head. Returns (tokens, last logits)."""
  host = jax.device_get(params)
  layers = placement.to_canonical(host['layers'], *layout)

  @jax.jit
  def logits_at(tokens_bt, pos):  # one shape for every step: the causal mask ignores the padding
    x = model_lib.embed_apply(dims, host, tokens_bt)
    x = jax.lax.scan(lambda h, p: (model_lib.block_apply(dims, p, h), None), x, layers)[0]
    return model_lib.head_apply(dims, host, x)[0, pos, : dims.vocab_size]

  buf = np.zeros((1, len(prompt) + n), np.int32)
  buf[0, : len(prompt)] = prompt
  out, logits = [], []
  for i in range(n):
    lg = np.asarray(logits_at(jnp.asarray(buf), len(prompt) + i - 1))
    logits.append(lg)
    out.append(int(np.argmax(lg)))
    buf[0, len(prompt) + i] = out[-1]
  return out, logits


def test_kv_cache_matches_full_forward(run):
  """10 greedy tokens: the KV-cache decoder on the sharded training layout gives the tokens, and
  at each step the logits, of the full forward pass recomputed on the whole sequence."""
  t, _ = run
  dims, layout = t.setup.dims, (t.cfg.model.n_layers, t.plan.pp, t.plan.repeats)
  prompt, n = list(b'def main(x):\n  return'), 10
  ref_tokens, ref_logits = _reference_greedy(dims, t.state['params'], layout, prompt, n)

  tokens = gen_lib.generate(
    dims, t.state['params'], layout, prompt, n, t.cfg.model.max_seq_len, temperature=0.0
  )
  assert tokens == ref_tokens
  assert len(set(ref_tokens)) > 1, ref_tokens  # a non-degenerate sequence, see the module docstring

  # The logits themselves, prefill then one token at a time through the cache.
  params = t.state['params']
  layers = placement.to_canonical(params['layers'], *layout)
  cache = gen_lib.empty_cache(dims, 1, t.cfg.model.max_seq_len)
  logits, cache = cached_logits(dims, params, layers, jnp.asarray([prompt], jnp.int32), cache, 0)
  for i in range(n):
    got = np.asarray(logits)[0, : dims.vocab_size]
    np.testing.assert_allclose(got, ref_logits[i], rtol=1e-4, atol=1e-4)
    logits, cache = cached_logits(
      dims, params, layers, jnp.asarray([[ref_tokens[i]]], jnp.int32), cache, len(prompt) + i
    )


def test_sharded_decoding_equals_one_device(run, monkeypatch):
  """Small models decode on one device (generate.ONE_DEVICE_BYTES); larger ones on the training
  layout. Both give the same greedy tokens and the same seeded draws."""
  t, _ = run
  dims, layout = t.setup.dims, (t.cfg.model.n_layers, t.plan.pp, t.plan.repeats)
  prompt, params = list(b'def main(x):\n  return'), t.state['params']
  args = (dims, params, layout, prompt, 16, t.cfg.model.max_seq_len)
  one = [gen_lib.generate(*args, temperature=0.0), gen_lib.generate(*args, temperature=1.0, seed=5)]
  monkeypatch.setattr(gen_lib, 'ONE_DEVICE_BYTES', 0)
  assert len(gen_lib._for_decoding(params)['embed']['embedding'].sharding.device_set) == 8
  sharded = [gen_lib.generate(*args, temperature=0.0), gen_lib.generate(*args, temperature=1.0, seed=5)]
  assert sharded == one


def test_generation_ends_after_the_stop_token(run):
  """`stop` (the tokenizer's EOS) ends generation on the device: the tokens are those of the run
  without it, up to and including the stop token's first appearance."""
  t, _ = run
  dims, layout = t.setup.dims, (t.cfg.model.n_layers, t.plan.pp, t.plan.repeats)
  args = (dims, t.state['params'], layout, list(b'def main(x):\n  return'), 16, t.cfg.model.max_seq_len)
  full = gen_lib.generate(*args, temperature=0.0)
  assert len(full) == 16
  end = full.index(full[5])
  assert gen_lib.generate(*args, temperature=0.0, stop=full[5]) == full[: end + 1]
  assert gen_lib.generate(*args, temperature=0.0, stop=-7) == full  # never drawn


def test_greedy_and_seeded_sampling_are_deterministic(run):
  t, workdir = run
  greedy = jax3d.sample(t, PROMPT, n_tokens=24, greedy=True)
  assert greedy == jax3d.sample(t, PROMPT, n_tokens=24, temperature=0.0)
  assert greedy == jax3d.sample(workdir, PROMPT, n_tokens=24, greedy=True)  # from the checkpoint
  a = jax3d.sample(t, PROMPT, n_tokens=24, temperature=1.0, top_k=40, seed=1)
  assert a == jax3d.sample(t, PROMPT, n_tokens=24, temperature=1.0, top_k=40, seed=1)
  assert a != jax3d.sample(t, PROMPT, n_tokens=24, temperature=1.0, top_k=40, seed=2)
  assert greedy.startswith(PROMPT) and a.startswith(PROMPT)


def test_top_k_one_is_greedy(run):
  """top_k=1 leaves only the argmax, whatever the temperature and seed."""
  t, _ = run
  assert jax3d.sample(t, PROMPT, n_tokens=12, temperature=5.0, top_k=1, seed=3) == jax3d.sample(
    t, PROMPT, n_tokens=12, greedy=True
  )


def test_cli_samples_on_another_layout(run):
  """Trained on dp=2 pp=2 tp=2; sampled on dp=1 pp=4 tp=2 (another pipeline layer order) by the
  CLI, with the config read from the checkpoint: the same greedy text as the trainer's own."""
  t, workdir = run
  want = jax3d.sample(t, PROMPT, n_tokens=24, greedy=True)
  r = _cli(
    f'--workdir={workdir}',
    f'--prompt={PROMPT}',
    '--tokens=24',
    '--greedy',
    '--config.mesh.dp=1',
    '--config.mesh.pp=4',
    '--config.mesh.tp=2',
  )
  assert r.returncode == 0, r.stderr.decode()
  out = r.stdout.decode('utf-8')
  assert out.startswith(PROMPT)
  assert out[:-1] == want  # print() adds one newline


def test_sampling_config_fixes_the_batch_for_a_new_layout():
  """dp 2 -> 8 on a batch of 16 with 4 micro-batches does not split; generation does not care,
  so the batch keys are adjusted, and the layout asked for is kept."""
  cfg = jax3d.load_config('tiny', SMALL)
  new = sampling.sampling_config(cfg, 8, {'mesh.dp': 8, 'mesh.pp': 1, 'mesh.tp': 1})
  assert (new.mesh.dp, new.mesh.pp, new.mesh.tp) == (8, 1, 1)
  assert new.pipeline.microbatches == 1 and new.train.global_batch_size == 8
  assert cfg.mesh.dp == 2 and cfg.train.global_batch_size == 16  # the original is untouched


def test_cli_without_checkpoint_exits_2(tmp_path):
  r = _cli(f'--workdir={tmp_path}', '--prompt=x')
  assert r.returncode == 2
  err = r.stderr.decode().strip().splitlines()
  assert len(err) == 1 and 'no checkpoint' in err[0], err


def test_cli_bad_flags_exit_2(capsys):
  assert sample_lib.main(['--workdir=x', '--tokens=many']) == 2
  assert sample_lib.main(['--prompt=x']) == 2  # no --workdir
  assert sample_lib.main(['--bogus=1', '--workdir=x']) == 2
  assert len(capsys.readouterr().err.strip().splitlines()) == 3


def test_module_is_callable_as_the_api_function(run):
  """`jax3d.sample` is the CLI's module and the API function at once (see sample.py)."""
  t, _ = run
  import jax3d.sample as module

  assert jax3d.sample is module
  assert module(t, PROMPT, n_tokens=5, greedy=True) == jax3d.api.sample(t, PROMPT, n_tokens=5, greedy=True)


def test_cli_prompt_past_the_context_exits_2(run):
  """A prompt that fills model.max_seq_len leaves nothing to generate: one error line naming the
  prompt's length and the limit, exit 2, before the weights load or anything compiles; one token
  shorter, it generates."""
  _, workdir = run
  most = jax3d.load_config('tiny', SMALL).model.max_seq_len
  r = _cli(f'--workdir={workdir}', '--prompt=' + 'x' * most, '--tokens=4', JAX_LOG_COMPILES='1')
  err = r.stderr.decode()
  lines = [l for l in err.splitlines() if l.startswith('error:')]
  assert r.returncode == 2 and len(lines) == 1 and 'Compiling' not in err, err[-2000:]
  assert f'is {most:,} tokens' in lines[0] and f'model.max_seq_len={most:,}' in lines[0], lines[0]
  r = _cli(f'--workdir={workdir}', '--prompt=' + 'x' * (most - 1), '--tokens=4', '--greedy')
  assert r.returncode == 0 and r.stdout.decode().startswith('x' * (most - 1)), r.stderr.decode()[-2000:]
