"""Hugging Face Llama weights in and out, compared with transformers on the same tokens.

A tiny random LlamaForCausalLM (GQA 8/4 heads, vocabulary 300: not a multiple of 128) is written
by transformers, imported with `checkpoint.init_from=hf:PATH` onto several layouts, and jax3d's
logits are compared with transformers' (fp32, relative to the logits' scale). Round trips go
through `jax3d.hf.writer` and `from_pretrained`.
"""

from __future__ import annotations

import json
import os
import shutil

import hf_helpers as H
import jax
import numpy as np
import pytest

from jax3d import assemble, config as config_lib
from jax3d.hf import config as hf_config, writer
from jax3d.model import generate
from jax3d.parallel import placement
from jax3d.trainer import workdir

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

TOL = 1e-4


@pytest.fixture(scope='module')
def models(tmp_path_factory):
  """{'untied': (path, torch model), 'tied': (...)}, written once for the module."""
  root = tmp_path_factory.mktemp('hf')
  out = {}
  for i, kind in enumerate(('untied', 'tied')):
    path = str(root / kind)
    out[kind] = (path, H.make_hf_model(path, tied=kind == 'tied', seed=i))
  return out


@pytest.mark.parametrize('kind', ['untied', 'tied'])
def test_imported_logits_equal_transformers_on_every_layout(models, kind):
  path, model = models[kind]
  assert hf_config.read(path).tied == (kind == 'tied')
  toks = H.tokens()
  ref = H.hf_logits(model, toks)
  errs = {}
  for layout in H.LAYOUTS:
    s, params = H.imported(path, layout)
    assert s.dims.vocab_padded == 384 and s.dims.n_kv_heads == 4
    errs[layout] = H.rel_err(H.jax3d_logits(s, params, toks), ref)
  print(kind, errs)
  assert max(errs.values()) < TOL, errs


def test_a_wrong_mapping_would_fail(models):
  """The comparison can fail: the same weights with two KV heads' K and V swapped are far off."""
  path, model = models['untied']
  toks = H.tokens()
  s, params = H.imported(path, (1, 1, 1))
  qkv = params['layers']['qkv']['kernel']
  g = s.dims.n_heads // s.dims.n_kv_heads
  params['layers']['qkv']['kernel'] = qkv.at[:, :, :, [g, g + 1]].set(qkv[:, :, :, [g + 1, g]])
  assert H.rel_err(H.jax3d_logits(s, params, toks), H.hf_logits(model, toks)) > 1e-2


def test_bf16_checkpoint_imports(tmp_path):
  """A bfloat16 safetensors file (numpy cannot read it; jax3d memory-maps it) gives the logits of
  the same bf16 weights in fp32."""
  H.make_hf_model(str(tmp_path), tied=False, seed=3, dtype='bfloat16')
  ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
  toks = H.tokens(1)
  s, params = H.imported(str(tmp_path), (2, 2, 2))
  assert H.rel_err(H.jax3d_logits(s, params, toks), H.hf_logits(ref_model, toks)) < TOL


@pytest.mark.parametrize('kind', ['untied', 'tied'])
def test_import_export_round_trip(models, kind, tmp_path):
  """import (1,2,4) -> export (split into several safetensors files) -> from_pretrained: the
  same logits as the original model, and the exported tensors equal the original ones."""
  path, model = models[kind]
  s, params = H.imported(path, (1, 2, 4))
  files = writer.export(params, s, str(tmp_path), max_shard_bytes=100_000)
  assert 'model.safetensors.index.json' in files and sum(f.endswith('.safetensors') for f in files) > 1
  back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  toks = H.tokens(2)
  assert H.rel_err(H.hf_logits(back, toks), H.hf_logits(model, toks)) < 1e-6
  sd = back.state_dict()
  for name, t in model.state_dict().items():
    np.testing.assert_array_equal(sd[name].numpy(), t.numpy(), err_msg=name)


def test_greedy_generation_matches_transformers(models):
  path, model = models['untied']
  s, params = H.imported(path, (1, 2, 4))
  prompt = [5, 17, 260, 3, 99]
  ours = generate.generate(s.dims, params, (s.dims.n_layers, s.plan.pp, s.plan.repeats), prompt, 12, 64, 0.0)
  with torch.no_grad():
    theirs = model.generate(
      torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )
  assert ours == theirs[0, len(prompt) :].tolist()


@pytest.mark.slow
def test_trained_checkpoint_exported_gives_jax3d_logits(models, tmp_path):
  """Fine-tune an import for 3 steps on (2,2,2), export the checkpoint with jax3d.export's function
  onto another layout, load it in transformers: its logits are jax3d's."""
  from jax3d.trainer.trainer import Trainer

  path, _ = models['untied']
  text = tmp_path / 'corpus.txt'
  text.write_text('def f(x):\n  return x + 1\n' * 400)
  cfg = H.jax3d_cfg(path, (2, 2, 2), **{'data.path': str(text), 'train.steps': 3, 'eval.every': 0})
  t = Trainer(cfg, workdir=str(tmp_path / 'run'), console=False)
  try:
    t.train()
    s, params = t.setup, t.state['params']
    toks = H.tokens(4, 256)
    ours = H.jax3d_logits(s, params, toks)
  finally:
    t.close()
  out = str(tmp_path / 'hf_out')
  workdir.export_workdir(str(tmp_path / 'run'), out, {'mesh.dp': 1, 'mesh.pp': 4, 'mesh.tp': 2})
  back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert H.rel_err(H.hf_logits(back, toks), ours) < TOL
  assert H.rel_err(ours, H.hf_logits(models['untied'][1], toks)) > 1e-4  # it did train


# --- bad input: exit 2, one line naming the file, before anything compiles --------------------
def _edit_config(src: str, dst: str, **changes: object) -> str:
  shutil.copytree(src, dst)
  with open(os.path.join(dst, 'config.json')) as f:
    c = json.load(f)
  c.update(changes)
  with open(os.path.join(dst, 'config.json'), 'w') as f:
    json.dump(c, f)
  return dst


def _bad_cases(models, tmp_path):
  path = models['untied'][0]
  no_cfg = tmp_path / 'no_cfg'
  shutil.copytree(path, no_cfg)
  os.remove(no_cfg / 'config.json')
  no_st = tmp_path / 'no_st'
  shutil.copytree(path, no_st)
  os.remove(no_st / 'model.safetensors')
  wrong = _edit_config(path, str(tmp_path / 'wrong'), intermediate_size=128)
  tok_dir = tmp_path / 'tok'
  tok_dir.mkdir()
  _tiny_tokenizer(str(tok_dir / 'tokenizer.json'), 400)
  return [
    ([f'hf:{no_cfg}'], [], ['no config.json', str(no_cfg)]),
    ([f'hf:{no_st}'], [], ['no *.safetensors', str(no_st)]),
    ([f'hf:{_edit_config(path, str(tmp_path / "bias"), attention_bias=True)}'], [], ['attention_bias=true']),
    ([f'hf:{_edit_config(path, str(tmp_path / "moe"), num_local_experts=8)}'], [], ['mixture of experts']),
    (
      [
        f'hf:{_edit_config(path, str(tmp_path / "qwen"), model_type="qwen2", architectures=["Qwen2ForCausalLM"])}'
      ],
      [],
      ['model.layers.0.self_attn.q_proj.bias', 'missing'],
    ),
    (
      [f'hf:{wrong}'],
      [],
      ['wrong/model.safetensors', 'model.layers.0.mlp.gate_proj.weight', '[96, 64]', '[128, 64]'],
    ),
    ([f'hf:{path}'], [f'--config.data.tokenizer={tok_dir}'], ['400 tokens', 'model.vocab_size=300']),
    (
      [f'hf:{path}'],
      ['--config.mesh.dp=1', '--config.mesh.pp=1', '--config.mesh.tp=8', '--config.train.seq_len=16'],
      ['model.n_kv_heads=4', 'mesh.tp=8', f'{path}/config.json'],
    ),
  ]


def _tiny_tokenizer(file: str, vocab: int) -> None:
  from tokenizers import Tokenizer, models as tm

  Tokenizer(tm.WordLevel({f'w{i}': i for i in range(vocab)}, unk_token='w0')).save(file)


def test_bad_imports_exit_2_with_one_line_before_compiling(models, tmp_path):
  from test_bad_input import run_cli

  for init, extra, words in _bad_cases(models, tmp_path):
    r = run_cli([f'--config.checkpoint.init_from={init[0]}', *extra], tmp_path)
    assert r.returncode == 2, (init, r.stderr[-2000:])
    lines = [l for l in r.stderr.splitlines() if l.startswith('error:')]
    assert len(lines) == 1, r.stderr
    for w in words:
      assert w in lines[0], (w, lines[0])
    assert 'Compiling' not in r.stderr


def test_resolve_derives_the_model_from_config_json(models):
  path, _ = models['tied']
  cfg = assemble.resolve(config_lib.load_config('tiny', {'checkpoint.init_from': f'hf:{path}'}))
  m = cfg.model
  got = (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size, m.rope_theta, m.max_seq_len)
  assert got == (4, 64, 8, 4, 96, 300, 500.0, 64)
  assert cfg.data.tokenizer == 'bytes'  # the folder has no tokenizer
  order = placement.layer_order(4, 2, 1)
  assert list(order) == [0, 1, 2, 3] and jax.device_count() == 8
