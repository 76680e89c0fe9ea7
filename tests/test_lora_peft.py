"""LoRA against the reference: a PEFT adapter (non-zero B) on a transformers-written tiny model,
fine-tuned 3 AdamW steps by jax3d and by transformers + peft + torch.optim.AdamW; the losses and
gradient norms agree within 1e-4, the adapters within a small fraction of one learning-rate step."""

from __future__ import annotations

import json
import os
import re

import hf_helpers as H
import jax
import numpy as np
import pytest

from jax3d import assemble, step as step_lib
from jax3d.data import packing
from jax3d.hf import peft as peft_io, weights as hf_weights
from jax3d.model import lora

torch = pytest.importorskip('torch')
peft = pytest.importorskip('peft')

MODULES = ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']
TRAIN = {'train.lr': 2e-3, 'train.warmup_steps': 0, 'train.steps': 3, 'train.grad_clip': 0.0}
TRAIN |= {'train.weight_decay': 0.1, 'train.b1': 0.9, 'train.b2': 0.95}
STEPS, TOL = 3, 1e-4


def make_adapter(
  base: str, out: str, rank: int = 4, alpha: float = 8.0, seed: int = 1, dropout: float = 0.0
) -> object:
  """A PEFT LoRA model over the folder `base` with every B drawn non-zero, its adapter saved to
  `out`; returns the peft model (train mode, lora_dropout `dropout`)."""
  from transformers import AutoModelForCausalLM

  model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
  conf = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=MODULES, lora_dropout=dropout)
  pm = peft.get_peft_model(model, conf)
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in pm.named_parameters():
      if 'lora_B' in name:
        p.normal_(0.0, 0.05)
  pm.save_pretrained(out)
  return pm


def batches(vocab: int) -> list[dict]:
  return [packing.one_document_rows(H.tokens(seed=10 + i, vocab=vocab, seq=H.SEQ + 1)) for i in range(STEPS)]


def jax3d_steps(base: str, adapter: str, layout: tuple, **over: object) -> tuple:
  """(losses, grad norms, learning rates, the adapters after the steps as PEFT tensors, the base
  before and after) of STEPS jax3d steps from the hf: base and the PEFT adapter."""
  cfg = H.jax3d_cfg(base, layout, **{'lora.init_from': adapter, **TRAIN, **over})
  s = assemble.build(cfg, jax.devices()[: int(np.prod(layout))])
  state = step_lib.make_init_from_params(s)(hf_weights.load_params(s))
  base0 = jax.device_get(lora.trainable(s.dims, state['params'])[1])
  train = assemble.compile_train_step(s)
  out = []
  for b in batches(s.dims.vocab_size):
    state, m = train(state, {k: jax.device_put(v, s.batch_sharding) for k, v in b.items()})
    out.append([float(m['loss']), float(m['grad_norm']), float(m['lr'])])
  adapters = {name: fetch() for name, _, _, fetch in peft_io.tensors(state['params'], s)}
  base1 = jax.device_get(lora.trainable(s.dims, state['params'])[1])
  return (*np.array(out).T, adapters, base0, base1)


def torch_steps(pm: object, lrs: np.ndarray, vocab: int) -> tuple:
  """(losses, grad norms, the adapters after the steps) of the same steps in torch."""
  params = [p for p in pm.parameters() if p.requires_grad]
  t = TRAIN
  opt = torch.optim.AdamW(
    params, lr=lrs[0], betas=(t['train.b1'], t['train.b2']), eps=1e-8, weight_decay=t['train.weight_decay']
  )
  losses, norms = [], []
  for lr, b in zip(lrs, batches(vocab), strict=True):
    for g in opt.param_groups:
      g['lr'] = float(lr)
    logits = pm(torch.as_tensor(b['inputs'], dtype=torch.long)).logits
    loss = torch.nn.functional.cross_entropy(
      logits.reshape(-1, logits.shape[-1]), torch.as_tensor(b['targets'], dtype=torch.long).reshape(-1)
    )
    opt.zero_grad()
    loss.backward()
    norms.append(float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))))
    losses.append(float(loss))
    opt.step()
  state = {k.replace('.default', ''): v.detach().numpy() for k, v in pm.state_dict().items() if 'lora_' in k}
  return np.array(losses), np.array(norms), state


@pytest.fixture(scope='module')
def llama(tmp_path_factory):
  root = tmp_path_factory.mktemp('lora')
  base, adapter = str(root / 'base'), str(root / 'adapter')
  H.make_hf_model(base, tied=False)
  make_adapter(base, adapter)
  return base, adapter


def compare(base: str, adapter: str, layout: tuple, **over: object) -> None:
  losses, norms, lrs, adapters, base0, base1 = jax3d_steps(base, adapter, layout, **over)
  t_losses, t_norms, t_state = torch_steps(make_adapter_model(base, adapter), lrs, H.TINY['vocab_size'])
  np.testing.assert_allclose(losses, t_losses, rtol=TOL, atol=0)
  np.testing.assert_allclose(norms, t_norms, rtol=TOL, atol=0)
  assert losses[-1] < losses[0]
  assert set(adapters) == set(t_state)
  for k, v in adapters.items():  # within 2% of one step's size (Adam's steps are ~lr each)
    np.testing.assert_allclose(v, t_state[k], rtol=0, atol=0.02 * TRAIN['train.lr'], err_msg=k)
  jax.tree.map(np.testing.assert_array_equal, base0, base1)  # the base, bit for bit


def make_adapter_model(base: str, adapter: str) -> object:
  """The saved adapter loaded by peft onto the base, trainable (what a user fine-tunes in torch)."""
  from transformers import AutoModelForCausalLM

  model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
  return peft.PeftModel.from_pretrained(model, adapter, is_trainable=True)


def test_three_adamw_steps_equal_peft_one_device(llama):
  compare(*llama, (1, 1, 1))


@pytest.mark.slow  # default-suite budget (CI runs -m slow too)
def test_qwen25_three_adamw_steps_equal_peft(tmp_path):
  """Qwen2.5 style (q/k/v biases, tied embeddings, GQA) on 2-2-2."""
  base, adapter = str(tmp_path / 'base'), str(tmp_path / 'adapter')
  H.make_family_model(base, 'qwen2.5')
  make_adapter(base, adapter)
  compare(base, adapter, (2, 2, 2))


@pytest.mark.slow
@pytest.mark.parametrize(
  'layout,over',
  [
    ((2, 2, 2), {}),
    ((1, 2, 4), {'train.sequence_parallel': 'true'}),
    ((2, 2, 2), {'pipeline.schedule': '1f1b', 'train.shard_optimizer': True}),
  ],
  ids=['2-2-2-m2', '1-2-4-sp', '2-2-2-1f1b-zero1'],
)
def test_three_adamw_steps_equal_peft_on_layouts(llama, layout, over):
  compare(*llama, layout, **over)


# --- checkpoints, resume, export ----------------------------------------------------------------
def run_cfg(base: str, adapter: str, tmp_path: object, layout: tuple = (1, 1, 1), **over: object) -> object:
  text = tmp_path / 'corpus.txt'
  text.write_text('def f(x):\n  return x + 1\n' * 400)
  over = {'lora.init_from': adapter, 'data.path': str(text), 'train.steps': 4, 'eval.every': 0, **over}
  return H.jax3d_cfg(base, layout, **{**TRAIN, 'train.steps': 4, **over})


@pytest.mark.slow  # 12 s (default-suite budget; CI runs -m slow)
def test_checkpoint_holds_the_adapters_and_resumes_exactly(llama, tmp_path):
  """A checkpoint holds the adapters and their optimizer state (and where the base came from); a
  run resumed from it continues bit for bit; a resume onto another base is refused."""
  import orbax.checkpoint as ocp

  from jax3d.errors import CheckpointError
  from jax3d.trainer import readonly
  from jax3d.trainer.trainer import Trainer

  base, adapter = llama
  one = jax.devices()[:1]
  straight = Trainer(run_cfg(base, adapter, tmp_path), str(tmp_path / 'a'), one, console=False)
  straight.train(steps=4)
  want = jax.device_get(straight.state)
  straight.close()
  first = Trainer(run_cfg(base, adapter, tmp_path), str(tmp_path / 'b'), one, console=False)
  first.train(steps=2)
  first.close()
  mgr = readonly.manager(str(tmp_path / 'b' / 'checkpoints'))
  meta = mgr.restore(2, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
  mgr.close()
  assert meta['lora_base'] == f'hf:{base}'
  saved = [k for k in meta['arrays'] if k.startswith('params/')]
  assert saved and all('/lora_' in k for k in saved)  # no base weights in the checkpoint
  second = Trainer(run_cfg(base, adapter, tmp_path), str(tmp_path / 'b'), one, console=False)
  assert 'resumed' in second.init_state()
  second.train(steps=2)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(second.state), want)
  second.close()
  other = str(tmp_path / 'other')
  H.make_hf_model(other, tied=False, seed=5)
  moved = Trainer(run_cfg(other, adapter, tmp_path), str(tmp_path / 'b'), one, console=False)
  with pytest.raises(CheckpointError, match='holds LoRA adapters of the base'):
    moved.init_state()
  moved.close()


@pytest.mark.slow  # default-suite budget (CI runs -m slow too)
def test_exported_adapter_and_merge_give_jax3d_logits(llama, tmp_path):
  """Train 2 steps on 2-2-2; the exported PEFT adapter loaded by peft onto the base, and the merged
  export loaded by transformers, give jax3d's logits; the merge is W + B A alpha/r. Both are staged
  exports (jax3d/hf/outdir.py), and neither may be written over the base or the starting adapter."""
  from transformers import AutoModelForCausalLM

  from jax3d.errors import UsageError
  from jax3d.hf import outdir, safetensors_io
  from jax3d.trainer import workdir

  base, adapter = llama
  run, toks = str(tmp_path / 'run'), H.tokens(4, 256)
  ours = H.trained_logits(run_cfg(base, adapter, tmp_path, (2, 2, 2), **{'train.steps': 2}), run, toks)
  one = {'mesh.dp': 1, 'mesh.pp': 1, 'mesh.tp': 1}
  out, merged = str(tmp_path / 'adapter_out'), str(tmp_path / 'merged_out')
  workdir.export_workdir(run, out, one, jax.devices()[:1], verify=True)
  four = {'mesh.dp': 1, 'mesh.pp': 2, 'mesh.tp': 2}
  workdir.export_workdir(run, merged, four, jax.devices()[:4], merge=True, verify=True)
  assert all(os.path.exists(f'{d}/{outdir.MARKER}') for d in (out, merged))
  assert not [n for n in os.listdir(tmp_path) if n.endswith(('.partial', '.old'))]
  for source, what in ((base, 'imported from'), (adapter, 'PEFT adapter the run started from')):
    with pytest.raises(UsageError, match=what):
      workdir.export_workdir(run, source, one, jax.devices()[:1], merge=source == base, overwrite=True)
  with_peft = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out).eval()
  assert H.rel_err(H.hf_logits(with_peft, toks), ours) < TOL
  assert H.rel_err(H.hf_logits(AutoModelForCausalLM.from_pretrained(merged).eval(), toks), ours) < TOL
  assert H.rel_err(ours, H.hf_logits(make_adapter_model(base, adapter).eval(), toks)) > 1e-4  # it trained
  read = lambda folder, file, name: safetensors_io.Reader().read(f'{folder}/{file}', name).astype(np.float64)
  scale = 8.0 / 4
  for i in range(H.TINY['num_hidden_layers']):
    for module in ('self_attn.q_proj', 'self_attn.o_proj', 'mlp.up_proj', 'mlp.down_proj'):
      p = f'model.layers.{i}.{module}'
      a, b = (read(out, peft_io.WEIGHTS, f'base_model.model.{p}.lora_{x}.weight') for x in 'AB')
      want = read(base, 'model.safetensors', f'{p}.weight') + scale * b @ a
      np.testing.assert_allclose(read(merged, 'model.safetensors', f'{p}.weight'), want, rtol=0, atol=1e-6)


def test_adapters_jax3d_cannot_represent_are_refused_naming_the_entry(llama, tmp_path):
  """rsLoRA, another module, a missing or misshapen tensor: ConfigError (exit 2) naming the entry."""
  import json
  import shutil

  from safetensors.numpy import load_file, save_file

  from jax3d.errors import ConfigError

  base, adapter = llama

  def edited(
    name: str, config: dict | None = None, drop: str | None = None, shape: tuple | None = None
  ) -> str:
    out = str(tmp_path / name)
    shutil.copytree(adapter, out)
    if config:
      with open(f'{out}/{peft_io.CONFIG}') as f:
        c = json.load(f) | config
      with open(f'{out}/{peft_io.CONFIG}', 'w') as f:
        json.dump(c, f)
    if drop or shape:
      t = load_file(f'{out}/{peft_io.WEIGHTS}')
      if drop:
        del t[drop]
      else:
        t[peft_io.key(1, 'v', 'b')] = np.zeros(shape, np.float32)
      save_file(t, f'{out}/{peft_io.WEIGHTS}', metadata={'format': 'pt'})
    return out

  cases = [
    (edited('rs', {'use_rslora': True}), 'use_rslora=True'),
    (edited('mods', {'target_modules': ['q_proj', 'lm_head']}), "target_modules=['q_proj', 'lm_head']"),
    (edited('miss', drop=peft_io.key(2, 'down', 'a')), 'layers.2.mlp.down_proj.lora_A.weight is missing'),
    (edited('shape', shape=(8, 3)), 'layers.1.self_attn.v_proj.lora_B.weight is shape (8, 3)'),
  ]
  for path, words in cases:
    cfg = H.jax3d_cfg(base, (1, 1, 1), **{'lora.init_from': path})
    with pytest.raises(ConfigError, match=re.escape(words)):
      s = assemble.build(cfg, jax.devices()[:1])
      hf_weights.load_params(s)


def test_exported_adapter_config_is_read_by_peft_as_the_run(tmp_path):
  """The default suite's guard of the exports above (no compile): the adapter_config.json jax3d
  writes for rank 4, alpha 8, dropout 0.1 on q and v reads back in peft as r=4, lora_alpha=8 (a
  scaling of 2), dropout 0.1, the same modules, and in jax3d as the same lora.* settings."""
  from jax3d import config as config_lib

  from helpers import setup_for, small_cfg

  over = dict(lora__rank=4, lora__alpha=8.0, lora__dropout=0.1, lora__targets='q,v', model__n_layers=2)
  s = setup_for(small_cfg(**over))
  out = tmp_path / 'adapter'
  out.mkdir()
  (out / peft_io.CONFIG).write_text(json.dumps(peft_io.config_json(s, str(tmp_path / 'base'))))
  from safetensors.numpy import save_file

  save_file({}, str(out / peft_io.WEIGHTS))  # read_config checks the weights file is readable
  c = peft.LoraConfig.from_pretrained(str(out))
  assert (c.r, c.lora_alpha, c.lora_dropout, sorted(c.target_modules)) == (4, 8.0, 0.1, ['q_proj', 'v_proj'])
  cfg = peft_io.with_lora(config_lib.load_config('tiny'), str(out))
  assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.targets) == (4, 8.0, 0.1, 'q,v')
