"""Today's open model families against transformers: a Llama 3.2 style model (tied, llama3 rope
scaling at rope_theta 500000, positions past its original context, config.json in transformers 5's
layout and the hub's older one), a Qwen2.5 style one (q/k/v biases, tied, GQA), a Qwen3 style one
(q/k norms, head_dim != hidden/heads) and a Mistral (a sliding window that covers the sequence), each written by transformers (hf_helpers.FAMILIES) and
imported onto every layout of hf_helpers.LAYOUTS: logits, greedy generation, parameter count,
import -> export -> from_pretrained, a fine-tune exported, and the folders that must not load."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import hf_helpers as H
import jax
import numpy as np
import pytest

from jax3d import assemble
from jax3d.config import ConfigError
from jax3d.hf import writer
from jax3d.model import generate
from jax3d.model.rope import RopeScaling
from jax3d.trainer import export_parity

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

TOL = 1e-4
SEQ = H.FAMILY_SEQ
FAST = [(1, 1, 1), (2, 2, 2)]
SLOW = [pytest.param(layout, marks=pytest.mark.slow) for layout in H.LAYOUTS if layout not in FAST]


@pytest.fixture(scope='module')
def families(tmp_path_factory):
  """{family: (path, torch model)}, written once for the module."""
  root = tmp_path_factory.mktemp('families')
  return {f: (str(root / f), H.make_family_model(str(root / f), f, seed=i)) for i, f in enumerate(H.FAMILIES)}


def _imported(path: str, layout: tuple[int, int, int], **over: object) -> tuple[object, object]:
  return H.imported(path, layout, **{'train.seq_len': SEQ, **over})


@pytest.mark.parametrize('layout', FAST + SLOW)
@pytest.mark.parametrize('family', list(H.FAMILIES))
def test_logits_equal_transformers(families, family, layout):
  path, model = families[family]
  toks = H.tokens(seq=SEQ)
  s, params = _imported(path, layout)
  err = H.rel_err(H.jax3d_logits(s, params, toks), H.hf_logits(model, toks))
  assert err < TOL, (family, layout, err)


def test_the_features_are_read_and_matter(families):
  """Each family's feature is on in the import, and the comparison above would catch its loss:
  the same weights without it are far from transformers."""
  expect = {
    'llama3.2': {'tie_embeddings': True, 'rope_scaling': 'llama3', 'rope_factor': 8.0, 'rope_theta': 5e5},
    'qwen2.5': {'qkv_bias': True, 'tie_embeddings': True, 'hf_model_type': 'qwen2'},
    'qwen3': {'qk_norm': True, 'head_dim': 16, 'tie_embeddings': False, 'hf_model_type': 'qwen3'},
    'mistral': {'hf_model_type': 'mistral', 'qkv_bias': False, 'qk_norm': False},
  }
  without = {
    'llama3.2': {'rope_scaling': RopeScaling()},
    'qwen2.5': {'qkv_bias': False},
    'qwen3': {'qk_norm': False},
    'mistral': None,  # a Llama with a window that covers the sequence: nothing to switch off
  }
  toks = H.tokens(seq=SEQ)
  for family, keys in expect.items():
    path, model = families[family]
    s, params = _imported(path, (1, 1, 1))
    for key, value in keys.items():
      assert getattr(s.cfg.model, key) == value, (family, key)
    if without[family] is None:
      continue
    s_off = dataclasses.replace(s, dims=dataclasses.replace(s.dims, **without[family]))
    if family != 'llama3.2':  # without the bias / norm parameters
      params = {**params, 'layers': _without(params['layers'], family)}
      shardings = {**s.param_shardings, 'layers': _without(s.param_shardings['layers'], family)}
      s_off = dataclasses.replace(s_off, param_shardings=shardings)
    assert H.rel_err(H.jax3d_logits(s_off, params, toks), H.hf_logits(model, toks)) > 1e-3, family


def _without(layers: dict, family: str) -> dict:
  if family == 'qwen2.5':
    return {**layers, 'qkv': {'kernel': layers['qkv']['kernel']}}
  return {k: v for k, v in layers.items() if k not in ('q_norm', 'k_norm')}


def test_config_json_in_the_hubs_older_layout_reads_the_same(families, tmp_path):
  """Llama 3.1+ on the hub: rope_scaling beside rope_theta (transformers 5 writes rope_parameters)."""
  path, model = families['llama3.2']
  old = str(tmp_path / 'old')
  shutil.copytree(path, old)
  with open(os.path.join(old, 'config.json')) as f:
    c = json.load(f)
  params = c.pop('rope_parameters')
  c['rope_theta'] = params.pop('rope_theta')
  c['rope_scaling'] = params
  with open(os.path.join(old, 'config.json'), 'w') as f:
    json.dump(c, f)
  new_cfg, old_cfg = (
    assemble.resolve(H.jax3d_cfg(p, (1, 1, 1), **{'train.seq_len': SEQ})) for p in (path, old)
  )
  assert 'rope_parameters' in json.load(open(os.path.join(path, 'config.json')))
  assert new_cfg.model.to_dict() == old_cfg.model.to_dict()
  toks = H.tokens(seq=SEQ)
  s, p = _imported(old, (1, 2, 4))
  assert H.rel_err(H.jax3d_logits(s, p, toks), H.hf_logits(model, toks)) < TOL


@pytest.mark.parametrize('family', list(H.FAMILIES))
def test_parameter_count_and_tied_table_counted_once(families, family):
  path, model = families[family]
  s, params = _imported(path, (2, 2, 2))
  assert s.dims.param_count() == model.num_parameters()
  assert ('out' in params['head']) != s.dims.tie_embeddings  # a tied head has no table of its own


@pytest.mark.parametrize('layout', [(1, 2, 4), pytest.param((1, 4, 2), marks=pytest.mark.slow)])
@pytest.mark.parametrize('family', list(H.FAMILIES))
def test_greedy_generation_of_32_tokens_matches_transformers(families, family, layout):
  path, model = families[family]
  s, params = _imported(path, layout)
  prompt = [5, 17, 260, 3, 99]
  ours = generate.generate(s.dims, params, (s.dims.n_layers, s.plan.pp, s.plan.repeats), prompt, 32, 64, 0.0)
  with torch.no_grad():
    theirs = model.generate(
      torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
    )
  assert ours == theirs[0, len(prompt) :].tolist()


@pytest.mark.parametrize('family', list(H.FAMILIES))
def test_import_export_round_trip_is_bit_identical(families, family, tmp_path):
  path, model = families[family]
  s, params = _imported(path, (2, 2, 2))
  writer.export(params, s, str(tmp_path))
  with open(os.path.join(path, 'config.json')) as f:
    src = json.load(f)
  with open(tmp_path / 'config.json') as f:
    out = json.load(f)
  for key in ('architectures', 'model_type', 'tie_word_embeddings'):
    assert out[key] == src[key], key
  back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  assert type(back) is type(model)
  sd = back.state_dict()
  assert sorted(sd) == sorted(model.state_dict())
  for name, t in model.state_dict().items():
    np.testing.assert_array_equal(sd[name].numpy(), t.numpy(), err_msg=name)


def test_tied_gradient_is_the_sum_of_both_uses(families):
  """The tied table's gradient equals the embedding's plus the head's of the same model untied."""
  from jax3d import loss as loss_lib, step as step_lib
  from jax3d.parallel import sharding

  path, _ = families['qwen2.5']
  toks = H.tokens(seq=SEQ)
  s, params = _imported(path, (1, 1, 2))
  untied = dataclasses.replace(s, dims=dataclasses.replace(s.dims, tie_embeddings=False))
  table = params['embed']['embedding']
  params_untied = {**params, 'head': {**params['head'], 'out': {'kernel': table.T}}}

  def grad(setup, p):
    def loss(p):
      with sharding.use_rules(setup.rules):
        return loss_lib.loss_sum(p, {'inputs': toks, 'targets': np.roll(toks, -1, 1)}, setup)

    return step_lib.MeshJit(jax.grad(loss), setup.mesh)(p)

  g_tied, g_untied = grad(s, params), grad(untied, params_untied)
  ref = np.asarray(g_untied['embed']['embedding']) + np.asarray(g_untied['head']['out']['kernel']).T
  np.testing.assert_allclose(np.asarray(g_tied['embed']['embedding']), ref, rtol=1e-4, atol=1e-6)
  assert np.abs(np.asarray(g_untied['head']['out']['kernel'])).max() > 1e-3  # both uses contribute


@pytest.mark.slow
@pytest.mark.parametrize('family', list(H.FAMILIES))
def test_fine_tune_exported_gives_jax3d_logits_in_transformers(families, family, tmp_path):
  """3 steps on (2,2,2), exported through `export_workdir(verify=True)` onto another layout: the
  export loads in transformers in its own architecture and gives jax3d's logits."""
  from jax3d.trainer import workdir

  path, model = families[family]
  text = tmp_path / 'corpus.txt'
  text.write_text('def f(x):\n  return x + 1\n' * 400)
  cfg = H.jax3d_cfg(path, (2, 2, 2), **{'data.path': str(text), 'train.steps': 3, 'eval.every': 0})
  toks = H.tokens(4, 256)
  ours = H.trained_logits(cfg, str(tmp_path / 'run'), toks)
  out = str(tmp_path / 'hf_out')
  workdir.export_workdir(str(tmp_path / 'run'), out, {'mesh.dp': 1, 'mesh.pp': 4, 'mesh.tp': 2}, verify=True)
  back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(back) is type(model)
  assert H.rel_err(H.hf_logits(back, toks), ours) < TOL
  assert H.rel_err(ours, H.hf_logits(model, toks)) > 1e-4  # it did train
  if family == 'qwen3':  # the command: the same check, one line, exit 0
    import subprocess
    import sys

    cmd = [sys.executable, '-m', 'jax3d.export', f'--workdir={tmp_path / "run"}', f'--out={tmp_path / "cli"}']
    r = subprocess.run(cmd + ['--verify'], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and 'verified' in r.stdout and 'within' in r.stdout, r.stdout + r.stderr[-2000:]


def _scale_tensor(folder: str, name: str, factor: float) -> None:
  """Multiplies the tensor `name` of the export at `folder` (one model.safetensors) by `factor`."""
  from safetensors.numpy import load_file, save_file

  file = os.path.join(folder, 'model.safetensors')
  tensors = load_file(file)
  tensors[name] = tensors[name] * factor
  save_file(tensors, file, metadata={'format': 'pt'})


def test_verify_fails_on_a_wrong_export(families, tmp_path):
  """verify's comparison can fail: an export whose one tensor was changed is reported (exit 3)."""
  path, _ = families['qwen3']
  s, params = _imported(path, (1, 1, 1))
  writer.export(params, s, str(tmp_path))
  toks = H.tokens(seq=SEQ)
  assert export_parity.verify(s, params, str(tmp_path), toks) < TOL
  _scale_tensor(str(tmp_path), 'model.layers.1.self_attn.k_norm.weight', 1.01)
  with pytest.raises(Exception) as e:
    export_parity.verify(s, params, str(tmp_path), toks)
  assert getattr(e.value, 'exit_status', None) == 3 and 'above 0.0001' in str(e.value)


def test_export_command_verify_exits_3_on_a_wrong_export(tmp_path, monkeypatch, capsys):
  """`python -m jax3d.export --verify` (its main, in this process) on a run's checkpoint (the small
  model at its seed, 8-1-1): exit 0 and its `verified` line; then, with the written folder made
  wrong after writing (the final norm scaled by 1.01, as a faulty export would write it), exit 3,
  one `error:` line saying the export fails the comparison, and no `wrote` line."""
  from jax3d import export as export_cmd
  from jax3d.trainer.trainer import Trainer

  from helpers import small_cfg

  run = str(tmp_path / 'run')
  cfg = small_cfg(mesh__dp=8, model__n_layers=2, train__global_batch_size=8)
  t = Trainer(cfg, workdir=run, console=False)
  try:
    t.init_state()
    t.save()
  finally:
    t.close()
  right = str(tmp_path / 'right')
  assert export_cmd.main([f'--workdir={run}', f'--out={right}', '--verify']) == 0
  out = capsys.readouterr().out
  assert f'verified {right}: ' in out and f'wrote {right}: model.safetensors' in out, out
  real = writer.export

  def wrong(params, setup, folder, *args, **kwargs):
    files = real(params, setup, folder, *args, **kwargs)
    _scale_tensor(folder, 'model.norm.weight', 1.01)
    return files

  monkeypatch.setattr(writer, 'export', wrong)
  bad = str(tmp_path / 'bad')
  assert export_cmd.main([f'--workdir={run}', f'--out={bad}', '--verify']) == 3
  printed = capsys.readouterr()
  errors = [l for l in printed.err.splitlines() if l.startswith('error:')]
  assert len(errors) == 1 and f'--verify: the export at {bad} gives logits' in errors[0], printed.err
  assert 'above 0.0001' in errors[0] and 'verified' not in printed.out and 'wrote' not in printed.out


# --- bad input: ConfigError (exit 2) naming the file, the key and the value, before compiling ----
def _edited(src: str, dst: str, drop: tuple[str, ...] = (), **changes: object) -> str:
  shutil.copytree(src, dst)
  with open(os.path.join(dst, 'config.json')) as f:
    c = json.load(f)
  c.update(changes)
  for key in drop:
    c.pop(key, None)
  with open(os.path.join(dst, 'config.json'), 'w') as f:
    json.dump(c, f)
  return dst


def _retensored(src: str, dst: str, name: str, shape: tuple[int, ...]) -> str:
  from safetensors.numpy import load_file, save_file

  shutil.copytree(src, dst)
  tensors = load_file(os.path.join(dst, 'model.safetensors'))
  tensors[name] = np.zeros(shape, np.float32)
  save_file(tensors, os.path.join(dst, 'model.safetensors'), metadata={'format': 'pt'})
  return dst


def test_folders_that_would_load_as_another_model_are_refused(families, tmp_path):
  llama, qwen2, qwen3 = (families[f][0] for f in ('llama3.2', 'qwen2.5', 'qwen3'))
  rope = lambda **kw: {'rope_parameters': {'rope_type': 'llama3', 'rope_theta': 5e5, **kw}}
  yarn = {'rope_parameters': {'rope_type': 'yarn', 'factor': 4.0, 'rope_theta': 5e5}}
  cases = [
    (_edited(llama, str(tmp_path / 'yarn'), **yarn), ['rope_parameters.rope_type="yarn"', 'llama3']),
    (
      _edited(
        llama,
        str(tmp_path / 'dyn'),
        drop=('rope_parameters',),
        rope_scaling={'type': 'dynamic', 'factor': 2.0},
      ),
      ['rope_scaling.rope_type="dynamic"'],
    ),
    (_edited(llama, str(tmp_path / 'l3'), **rope(factor=8.0)), ['rope_parameters.low_freq_factor=null']),
    (_edited(llama, str(tmp_path / 'inter'), rope_interleaved=True), ['rope_interleaved=true']),
    (_edited(llama, str(tmp_path / 'partial'), partial_rotary_factor=0.5), ['partial_rotary_factor=0.5']),
    (_edited(llama, str(tmp_path / 'mlpb'), mlp_bias=True), ['mlp_bias=true']),
    (_edited(llama, str(tmp_path / 'gelu'), hidden_act='gelu'), ['hidden_act="gelu"']),
    (_edited(llama, str(tmp_path / 'cap'), attn_logit_softcapping=50.0), ['attn_logit_softcapping=50.0']),
    (_edited(qwen3, str(tmp_path / 'bias3'), attention_bias=True), ['attention_bias=true']),
    (_edited(qwen2, str(tmp_path / 'quant'), quantization_config={'bits': 4}), ['quantization_config=']),
    (
      _edited(qwen2, str(tmp_path / 'swa'), use_sliding_window=True, sliding_window=8),
      ['sliding_window=8', 'train.seq_len=32'],
    ),
    (
      _retensored(qwen2, str(tmp_path / 'qb'), 'model.layers.2.self_attn.k_proj.bias', (7,)),
      ['k_proj.bias', '[7]', '[32]'],
    ),
    (
      _retensored(qwen3, str(tmp_path / 'qn'), 'model.layers.0.self_attn.q_norm.weight', (8,)),
      ['q_norm.weight', '[8]', '[16]'],
    ),
  ]
  for path, words in cases:
    with pytest.raises(ConfigError) as e:
      assemble.resolve(H.jax3d_cfg(path, (1, 1, 1), **{'train.seq_len': SEQ}))
    msg = str(e.value)
    assert '\n' not in msg and path in msg, msg
    for w in words:
      assert w in msg, (w, msg)
  # The mesh against a model whose heads are not hidden/heads: tp=8 does not divide its 4 KV heads.
  with pytest.raises(ConfigError, match=r'model.n_kv_heads=4.*mesh.tp=8'):
    assemble.build(H.jax3d_cfg(qwen3, (1, 1, 8), **{'train.seq_len': SEQ}), jax.devices())


def test_the_cli_exits_2_with_one_line(families, tmp_path):
  from test_bad_input import run_cli

  path = _edited(
    families['llama3.2'][0], str(tmp_path / 'yarn'), rope_parameters={'rope_type': 'yarn', 'factor': 4.0}
  )
  r = run_cli([f'--config.checkpoint.init_from=hf:{path}', f'--config.train.seq_len={SEQ}'], tmp_path)
  assert r.returncode == 2, r.stderr[-2000:]
  lines = [line for line in r.stderr.splitlines() if line.startswith('error:')]
  assert len(lines) == 1 and 'yarn' in lines[0] and 'config.json' in lines[0], r.stderr
  assert 'Compiling' not in r.stderr


# --- prompts encoded as the tokenizer does; generation straight from a folder --------------------
def _word_tokenizer(folder: str, bos_added: bool) -> None:
  """tokenizer.json: words w0..w297, and <s> (298) and </s> (299) as special tokens; a
  post-processor that adds <s> only when `bos_added`; tokenizer_config.json naming them."""
  from tokenizers import Tokenizer, models as tm, pre_tokenizers, processors

  vocab = {f'w{i}': i for i in range(298)} | {'<s>': 298, '</s>': 299}
  tok = Tokenizer(tm.WordLevel(vocab, unk_token='w0'))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(['<s>', '</s>'])
  if bos_added:
    tok.post_processor = processors.TemplateProcessing(single='<s> $A', special_tokens=[('<s>', 298)])
  tok.save(os.path.join(folder, 'tokenizer.json'))
  with open(os.path.join(folder, 'tokenizer_config.json'), 'w') as f:
    json.dump({'tokenizer_class': 'PreTrainedTokenizerFast', 'bos_token': '<s>', 'eos_token': '</s>'}, f)


@pytest.mark.parametrize('bos_added', [False, True])
def test_sampling_from_a_folder_continues_the_prompt_as_transformers_does(families, tmp_path, bos_added):
  """`python -m jax3d.sample --config.checkpoint.init_from=hf:DIR` (no run, another layout): the
  prompt's ids are transformers' (BOS only where the post-processor adds it), the greedy
  continuation is transformers', no Orbax warning, and one note when BOS is defined but not added."""
  import subprocess
  import sys

  from jax3d.data import tokenizer as tok_lib

  folder = str(tmp_path / 'm')
  shutil.copytree(families['qwen3'][0], folder)
  _word_tokenizer(folder, bos_added)
  prompt = 'w5 w17 w260 w3'
  hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
  ids = hf_tok(prompt)['input_ids']
  tok = tok_lib.HFTokenizer(os.path.join(folder, 'tokenizer.json'))
  assert tok.encode(prompt, add_special_tokens=True) == ids
  assert (ids[0] == 298) == bos_added
  model = families['qwen3'][1]
  greedy = lambda ids: model.generate(
    torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
  )[0].tolist()
  with torch.no_grad():
    out, other = greedy(ids), greedy([298] + ids if not bos_added else ids[1:])
  want = hf_tok.decode(out, skip_special_tokens=True)
  assert want != hf_tok.decode(other, skip_special_tokens=True)  # the test can tell BOS from none
  cmd = [
    sys.executable,
    '-m',
    'jax3d.sample',
    f'--config.checkpoint.init_from=hf:{folder}',
    f'--prompt={prompt}',
  ]
  cmd += ['--greedy', '--tokens=12', '--config.mesh.tp=2', '--config.mesh.pp=2', '--config.mesh.dp=2']
  r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.strip() == want
  assert 'WARNING' not in r.stderr, r.stderr
  notes = [line for line in r.stderr.splitlines() if line.startswith('note:')]
  assert len(notes) == (0 if bos_added else 1), r.stderr
