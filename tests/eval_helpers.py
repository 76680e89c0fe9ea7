"""A tiny transformers-written model with a real (byte-level BPE) tokenizer, and lm-eval tasks over
local JSONL files: a multiple-choice task, a generation task and a rolling log-likelihood task,
for comparing jax3d's lm-eval model with lm-eval's own `hf` model (offline)."""

from __future__ import annotations

import json
import os
import sysconfig

MC_TASK, GEN_TASK, ROLL_TASK = 'j3_mc', 'j3_gen', 'j3_roll'
MAX_LENGTH = 64  # the `hf` model's max_length and jax3d's train.seq_len

WORDS = 'the cat dog sat ran on a mat log red blue big small fast slow and then home'.split()


def make_model(folder: str, seed: int = 0, layers: int = 2) -> object:
  """A random Llama (vocab of the tokenizer, 2 layers) and its tokenizer.json (byte-level BPE
  with <s> added at the front, </s> as EOS) written to `folder`; returns the torch model."""
  import torch
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  from transformers import LlamaConfig, LlamaForCausalLM

  os.makedirs(folder, exist_ok=True)
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  text = open(os.path.join(sysconfig.get_paths()['stdlib'], 'json', 'decoder.py')).read()
  trainer = trainers.BpeTrainer(
    vocab_size=320,
    special_tokens=['<s>', '</s>'],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator([text, ' '.join(WORDS) * 3], trainer)
  tok.post_processor = processors.TemplateProcessing(single='<s> $A', special_tokens=[('<s>', 0)])
  tok.save(os.path.join(folder, 'tokenizer.json'))
  with open(os.path.join(folder, 'tokenizer_config.json'), 'w') as f:
    json.dump(
      {
        'tokenizer_class': 'PreTrainedTokenizerFast',
        'bos_token': '<s>',
        'eos_token': '</s>',
        'clean_up_tokenization_spaces': False,
      },
      f,
    )
  conf = LlamaConfig(
    vocab_size=tok.get_vocab_size(),
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=layers,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=MAX_LENGTH,
    rope_theta=500.0,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
  )
  torch.manual_seed(seed)
  model = LlamaForCausalLM(conf).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith('norm.weight'):
        p.copy_(1 + 0.1 * torch.randn_like(p))
      else:  # larger weights: logits far apart, so argmaxes do not hinge on rounding
        p.mul_(3.0)
  model.save_pretrained(folder)
  return model


def _sentence(rng: object, n: int) -> str:
  return ' '.join(rng.choice(WORDS) for _ in range(n))


def write_tasks(folder: str, n: int = 6) -> str:
  """Three task YAMLs over JSONL files in `folder` (absolute paths); returns the folder."""
  import random

  rng = random.Random(0)
  os.makedirs(folder, exist_ok=True)
  data = {
    MC_TASK: [
      {
        'q': _sentence(rng, 3 + i % 4),
        'choices': [_sentence(rng, 1 + (i + j) % 3) for j in range(4)],
        'label': i % 4,
      }
      for i in range(n)
    ],
    GEN_TASK: [{'q': _sentence(rng, 2 + i % 5), 'a': _sentence(rng, 2)} for i in range(n)],
    ROLL_TASK: [{'text': _sentence(rng, 10 + 17 * i)} for i in range(n)],
  }
  for name, rows in data.items():
    with open(os.path.join(folder, f'{name}.jsonl'), 'w') as f:
      f.writelines(json.dumps(r) + '\n' for r in rows)
  common = lambda name: (
    f'task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n'
    f'    test: {os.path.join(os.path.abspath(folder), name + ".jsonl")}\ntest_split: test\n'
  )
  yamls = {
    MC_TASK: 'output_type: multiple_choice\ndoc_to_text: "Q: {{q}}\\nA:"\ndoc_to_choice: "{{choices}}"\n'
    'doc_to_target: label\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n',
    GEN_TASK: 'output_type: generate_until\ndoc_to_text: "Q: {{q}}\\nA:"\ndoc_to_target: " {{a}}"\n'
    'generation_kwargs:\n  until: ["\\n", "p"]\n  max_gen_toks: 12\n  do_sample: false\n'
    'metric_list:\n  - metric: exact_match\n',
    ROLL_TASK: 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
    'metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n',
  }
  for name, body in yamls.items():
    with open(os.path.join(folder, f'{name}.yaml'), 'w') as f:
      f.write(common(name) + body + 'metadata:\n  version: 1.0\n')
  return folder
