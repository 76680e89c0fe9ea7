"""Mixtral and Qwen3-MoE from Hugging Face: tiny random models written by transformers (one tensor
per expert, as `save_pretrained` writes) and in transformers 5's fused expert tensors, imported:
logits, greedy tokens and parameter count equal transformers' with a capacity that drops nothing;
exported in both layouts and loaded back bit for bit."""

from __future__ import annotations

import json
import os

import hf_helpers as H
import numpy as np
import pytest

from jax3d.hf import writer
from jax3d.model import generate

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
safetensors_torch = pytest.importorskip('safetensors.torch')

SEQ, TOL = 16, 1e-5
E, K = 4, 2
FAMILIES = {
  # Mixtral: top-k weights renormalised (always); Qwen3-MoE: q/k norms, head_dim 16, its own expert
  # size, and norm_topk_prob false (the raw softmax weights)
  'mixtral': dict(cls='Mixtral', num_local_experts=E, num_experts_per_tok=K),
  'qwen3_moe': dict(
    cls='Qwen3Moe',
    num_experts=E,
    num_experts_per_tok=K,
    moe_intermediate_size=32,
    head_dim=16,
    norm_topk_prob=False,
  ),
}
DROP_NOTHING = {'moe.capacity_factor': E / K}  # capacity = t: every assignment has a slot


def make(path: str, family: str, seed: int, fused: bool) -> object:
  """A random model of `family`, saved per expert (save_pretrained) or with its fused tensors as
  transformers 5 holds them in memory; norms and the router randomised (a decisive routing)."""
  model = H.make_family_model(path, family, seed, FAMILIES, spread='mlp.gate.weight')
  if fused:
    os.remove(os.path.join(path, 'model.safetensors'))
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    safetensors_torch.save_file(sd, os.path.join(path, 'model.safetensors'), metadata={'format': 'pt'})
  return model


@pytest.fixture(scope='module')
def models(tmp_path_factory):
  root = tmp_path_factory.mktemp('hf_moe')
  out = {}
  for i, family in enumerate(FAMILIES):
    for fused in (False, True):
      path = str(root / f'{family}_{"fused" if fused else "experts"}')
      out[family, fused] = (path, make(path, family, seed=i, fused=fused))
  return out


def imported(path: str, layout: tuple[int, int, int], **over: object) -> tuple[object, object]:
  return H.imported(path, layout, **{'train.seq_len': SEQ, **DROP_NOTHING, **over})


def test_the_fused_folder_really_is_fused(models):
  from jax3d.hf import config as hf_config

  for family in FAMILIES:
    per, fused = (hf_config.read(models[family, f][0]) for f in (False, True))
    assert not hf_config.fused_experts(per) and hf_config.fused_experts(fused)
    assert any('experts.0.' in n for n in per.tensors) and not any('experts.0.' in n for n in fused.tensors)


@pytest.mark.parametrize('fused', [False, True])
@pytest.mark.parametrize('family', list(FAMILIES))
def test_logits_and_parameter_count_equal_transformers(models, family, fused):
  path, model = models[family, fused]
  toks = H.tokens(seq=SEQ)
  s, params = imported(path, (1, 1, 1))
  assert s.dims.n_experts == E and s.dims.top_k == K
  assert s.dims.norm_topk_prob == (family == 'mixtral')
  assert s.dims.param_count() == model.num_parameters()
  ref = H.hf_logits(model, toks)
  assert H.rel_err(H.jax3d_logits(s, params, toks), ref) < TOL
  if not fused:  # a capacity that drops tokens gives other numbers (the comparison sees routing)
    s2, p2 = imported(path, (1, 1, 1), **{'moe.capacity_factor': 0.5})
    assert H.rel_err(H.jax3d_logits(s2, p2, toks), ref) > 1e-3


@pytest.mark.parametrize('family', list(FAMILIES))
def test_logits_equal_transformers_with_tp_and_pp(models, family):
  path, model = models[family, False]
  toks = H.tokens(seq=SEQ)
  s, params = imported(path, (1, 2, 2))
  assert H.rel_err(H.jax3d_logits(s, params, toks), H.hf_logits(model, toks)) < TOL


@pytest.mark.parametrize('layout', [{'mesh.ep': 2, 'mesh.tp': 2}, {'mesh.ep': 4, 'mesh.tp': 2}])
@pytest.mark.parametrize('family', list(FAMILIES))
def test_logits_equal_transformers_with_ep(models, family, layout):
  """Imported straight onto layouts with the experts split over ep (each device reads its experts'
  blocks): transformers' logits."""
  import jax

  from jax3d import assemble
  from jax3d.hf import weights

  path, model = models[family, True]
  over = {'mesh.dp': 1, 'mesh.pp': 1, 'pipeline.microbatches': 1, **layout}
  cfg = H.jax3d_cfg(path, (1, 1, 1), **{'train.seq_len': SEQ, **DROP_NOTHING, **over})
  n = over['mesh.dp'] * over['mesh.ep'] * over['mesh.tp']
  s = assemble.build(cfg, jax.devices()[:n])
  params = weights.load_params(s)
  assert (
    params['layers']['moe']['experts_down'].sharding.shard_shape(
      (4, E, 32 if family == 'qwen3_moe' else 96, 64)
    )[1]
    == E // over['mesh.ep']
  )
  toks = H.tokens(seq=SEQ)
  assert H.rel_err(H.jax3d_logits(s, params, toks), H.hf_logits(model, toks)) < TOL


@pytest.mark.parametrize('family', list(FAMILIES))
def test_greedy_generation_matches_transformers(models, family):
  path, model = models[family, False]
  s, params = imported(path, (1, 1, 2))
  prompt = [5, 17, 260, 3, 99]
  ours = generate.generate(s.dims, params, (s.dims.n_layers, s.plan.pp, s.plan.repeats), prompt, 16, 64, 0.0)
  with torch.no_grad():
    theirs = model.generate(
      torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
    )
  assert ours == theirs[0, len(prompt) :].tolist()


@pytest.mark.parametrize('fused', [False, True])
@pytest.mark.parametrize('family', list(FAMILIES))
def test_export_round_trip_is_bit_identical(models, family, fused, tmp_path):
  """Imported per expert, exported per expert or fused: transformers loads either into the same
  weights, and the config keys of the mixture come back."""
  path, model = models[family, False]
  s, params = imported(path, (1, 2, 2))
  writer.export(params, s, str(tmp_path), fused_experts=fused)
  with open(os.path.join(path, 'config.json')) as f:
    src = json.load(f)
  with open(tmp_path / 'config.json') as f:
    out = json.load(f)
  for key in ('architectures', 'model_type', 'num_experts_per_tok', 'num_local_experts'):
    assert out.get(key, out.get('num_experts')) == src[key], key
  back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  assert type(back) is type(model)
  sd = back.state_dict()
  assert sorted(sd) == sorted(model.state_dict())
  for name, t in model.state_dict().items():
    np.testing.assert_array_equal(sd[name].numpy(), t.numpy(), err_msg=name)


@pytest.mark.parametrize(
  'edit,words',
  [
    ({'mlp_only_layers': [0]}, 'mlp_only_layers=[0]'),
    ({'decoder_sparse_step': 2}, 'decoder_sparse_step=2'),
    ({'num_experts_per_tok': None}, 'lacks num_local_experts or num_experts_per_tok'),
  ],
)
def test_a_mixture_jax3d_does_not_compute_is_refused(models, tmp_path, edit, words):
  """Dense layers among the experts (Qwen3-MoE's mlp_only_layers, decoder_sparse_step) are not
  built: refused by name before anything compiles, as is a mixture without its top-k."""
  import shutil

  from jax3d.config import ConfigError
  from jax3d.hf import config as hf_config

  src, _ = models['qwen3_moe', True]
  dst = str(tmp_path / 'edited')
  shutil.copytree(src, dst)
  with open(os.path.join(dst, 'config.json')) as f:
    c = json.load(f)
  c.update(edit)
  with open(os.path.join(dst, 'config.json'), 'w') as f:
    json.dump(c, f)
  with pytest.raises(ConfigError, match=words.replace('[', r'\[').replace(']', r'\]')):
    hf_config.read(dst)
