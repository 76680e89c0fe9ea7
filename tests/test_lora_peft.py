"""LoRA against the reference: a PEFT adapter (non-zero B) on a transformers-written tiny model,
fine-tuned 3 AdamW steps by jax3d and by transformers + peft + torch.optim.AdamW; the losses and
gradient norms agree within 1e-4, the adapters within a small fraction of one learning-rate step."""

from __future__ import annotations

import hf_helpers as H
import jax
import numpy as np
import pytest

from jax3d import assemble
from jax3d.data import packing
from jax3d.hf import peft as peft_io, weights as hf_weights
from jax3d.model import lora
from jax3d.training import step as step_lib

torch = pytest.importorskip('torch')
peft = pytest.importorskip('peft')

MODULES = ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']
TRAIN = {'train.lr': 2e-3, 'train.warmup_steps': 0, 'train.steps': 3, 'train.grad_clip': 0.0}
TRAIN |= {'train.weight_decay': 0.1, 'train.b1': 0.9, 'train.b2': 0.95}
STEPS, TOL = 3, 1e-4


def make_adapter(base: str, out: str, rank: int = 4, alpha: float = 8.0, seed: int = 1) -> object:
  """A PEFT LoRA model over the folder `base` with every B drawn non-zero, its adapter saved to
  `out`; returns the peft model (train mode, dropout 0)."""
  from transformers import AutoModelForCausalLM

  model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
  conf = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=MODULES, lora_dropout=0.0)
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

  model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
  return peft.PeftModel.from_pretrained(model, adapter, is_trainable=True)


def test_three_adamw_steps_equal_peft_one_device(llama):
  compare(*llama, (1, 1, 1))


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
