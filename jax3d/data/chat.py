"""Chat data: a conversation rendered with the tokenizer folder's own chat template, its token ids
and a loss weight per token (1 on the assistant turns, 0 elsewhere). Behind `jax3d.prepare
--format=chat`; imports no jax.

The template is the folder's `chat_template.jinja`, else `chat_template` in tokenizer_config.json
(a name -> template list: its 'default'), rendered with jinja2 as transformers renders it
(`apply_chat_template`): a sandboxed environment with trim_blocks and lstrip_blocks, loop controls,
the `{% generation %}` tag, the globals raise_exception and strftime_now, a `tojson` that does not
escape HTML, the tokenizer's special tokens (bos_token, eos_token, ...) as variables, and
add_generation_prompt=False. The text is tokenized whole with no special tokens added, so the ids
are those of `apply_chat_template(messages, tokenize=True)`.

The supervised tokens are found by rendering prefixes, so a stock template works unchanged: for
the assistant message j, the first j messages with the generation prompt render to where its
answer starts, the first j + 1 messages to where its turn ends (the end-of-turn token included).
Every such prefix must be a prefix of the whole conversation's text, or the template does not
render prefixes consistently and the conversation is refused. A token is supervised when its
characters overlap an answer's (transformers' rule for assistant masks).

Errors are ValueError naming the file, the line and the value: a line without a `messages` list,
an unknown role, a template that fails or does not render prefixes consistently, a conversation
with no supervised token. (jax3d.prepare turns them into exit status 2 and one line.)
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime
from typing import Any

import numpy as np

ROLES = ('system', 'developer', 'user', 'assistant', 'tool', 'ipython')
SUPERVISED_ROLE = 'assistant'
SPECIAL_TOKENS = ('bos_token', 'eos_token', 'unk_token', 'sep_token', 'pad_token', 'cls_token', 'mask_token')
_REASONING = ('reasoning_content', 'thinking', 'reasoning')


@dataclasses.dataclass(frozen=True)
class Template:
  """A tokenizer folder's chat template and the special tokens it is rendered with."""

  source: str
  specials: dict  # {'bos_token': '<s>', ...}
  path: str  # the file it was read from


def _read_json(path: str) -> dict:
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except FileNotFoundError:
    return {}
  except (OSError, ValueError) as e:
    raise ValueError(f'{path} cannot be read ({e})') from None


def load_template(folder: str) -> Template:
  """The chat template of a tokenizer folder (see the module docstring); ValueError when it has none."""
  cfg_path = os.path.join(folder, 'tokenizer_config.json')
  cfg = _read_json(cfg_path)
  specials = _read_json(os.path.join(folder, 'special_tokens_map.json')) | cfg  # the config's win
  text = lambda v: v.get('content') if isinstance(v, dict) else v
  specials = {k: text(specials[k]) for k in SPECIAL_TOKENS if isinstance(text(specials.get(k)), str)}
  jinja_path = os.path.join(folder, 'chat_template.jinja')
  if os.path.exists(jinja_path):
    with open(jinja_path, encoding='utf-8') as f:
      return Template(f.read(), specials, jinja_path)
  source = cfg.get('chat_template')
  if isinstance(source, list):  # [{'name': ..., 'template': ...}, ...]
    source = {t.get('name'): t.get('template') for t in source if isinstance(t, dict)}.get('default')
  if not isinstance(source, str) or not source:
    raise ValueError(
      f'--tokenizer={folder}: the folder has no chat template (no chat_template.jinja, and no '
      f'"chat_template" in {cfg_path} or no "default" one): --format=chat renders with it'
    )
  return Template(source, specials, cfg_path)


_COMPILED: dict[str, Any] = {}


def _compiled(source: str) -> Any:
  """The template compiled in transformers' jinja environment (cached)."""
  if source in _COMPILED:
    return _COMPILED[source]
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers' assistant-mask marker, rendered as is."""

    tags = {'generation'}

    def parse(self, parser: Any) -> Any:
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method('_body'), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
      return caller()

  def raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)

  def tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
  ) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
  )
  env.filters['tojson'] = tojson
  env.globals['raise_exception'] = raise_exception
  env.globals['strftime_now'] = lambda fmt: datetime.now().strftime(fmt)
  _COMPILED[source] = env.from_string(source)
  return _COMPILED[source]


def _normalized(messages: list[dict]) -> list[dict]:
  """What transformers renders: None-valued keys dropped, reasoning under all its names."""
  out = []
  for m in messages:
    m = {k: v for k, v in m.items() if v is not None}
    reasoning = next((m[k] for k in _REASONING if m.get(k) is not None), None)
    out.append(m if reasoning is None else {'thinking': reasoning, **m, 'reasoning_content': reasoning})
  return out


def render(t: Template, messages: list[dict], add_generation_prompt: bool = False) -> str:
  """The text of `messages` under the template (what apply_chat_template(tokenize=False) gives)."""
  return _compiled(t.source).render(
    messages=_normalized(messages),
    tools=None,
    documents=None,
    add_generation_prompt=add_generation_prompt,
    **t.specials,
  )


def parse(line: str, where: str) -> list[dict]:
  """The messages of one JSONL line, each message's content a string (`content`); ValueError
  naming `where` (file:line) when it has none, a message has an unknown role or its content is
  neither text nor a list of text parts."""
  try:
    record = json.loads(line)
  except ValueError as e:
    raise ValueError(f'{where}: not a JSON object ({e})') from None
  messages = record.get('messages') if isinstance(record, dict) else None
  if not isinstance(messages, list) or not messages:
    raise ValueError(f'{where}: no "messages" list in {line.strip()[:80]!r}')
  for j, m in enumerate(messages):
    role = m.get('role') if isinstance(m, dict) else None
    if role not in ROLES:
      raise ValueError(f'{where}: unknown role {role!r} in a message (expected one of {", ".join(ROLES)})')
    if m.get('content') is not None:
      messages[j] = m | {'content': content(m['content'], f'{where}: message {j + 1} ({role})')}
  return messages


def content(value: Any, where: str) -> str:
  """A message's content as text: a string as it is; a list of text parts (the OpenAI format,
  [{"type": "text", "text": ...}, ...]) joined by newlines, as the templates expect a string
  (vLLM joins them so too). ValueError naming `where` for anything else (an image part, a number)."""
  if isinstance(value, str):
    return value
  parts = value if isinstance(value, list) else None
  texts = [p.get('text') for p in parts if isinstance(p, dict) and p.get('type') == 'text'] if parts else []
  if parts is None or len(texts) != len(parts) or not all(isinstance(t, str) for t in texts):
    odd = (
      next((p for p in parts if not (isinstance(p, dict) and p.get('type') == 'text')), None)
      if parts
      else value
    )
    raise ValueError(
      f'{where}: content {json.dumps(odd)[:60]} is not text: a string, or a list of '
      '{"type": "text", "text": "..."} parts'
    )
  return '\n'.join(texts)


def supervised_spans(t: Template, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
  """(the conversation's text, the character spans of its assistant turns): see the module
  docstring. ValueError naming `where` when a prefix does not render as a prefix of the text."""
  import jinja2

  try:
    text = render(t, messages)
    spans = []
    for j, m in enumerate(messages):
      if m['role'] != SUPERVISED_ROLE:
        continue
      start, end = render(t, messages[:j], add_generation_prompt=True), render(t, messages[: j + 1])
      for n, how, prefix in ((j, ' with the generation prompt', start), (j + 1, '', end)):
        if not text.startswith(prefix):
          raise ValueError(
            f'{where}: the chat template does not render prefixes consistently: the first {n} '
            f"messages{how} render to text that is not a prefix of the whole conversation's "
            f'(it ends {prefix[-40:]!r})'
          )
      if len(end) > len(start):
        spans.append((len(start), len(end)))
  except jinja2.exceptions.TemplateError as e:
    raise ValueError(f'{where}: the chat template fails on this conversation: {str(e)[:200]}') from None
  return text, spans


def token_weights(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
  """1 for each token (character offsets) that overlaps a span, else 0 (uint8)."""
  w = np.zeros(len(offsets), np.uint8)
  k = 0
  for i, (a, b) in enumerate(offsets):
    while k < len(spans) and a >= spans[k][1]:
      k += 1
    if k == len(spans):
      break
    if b > spans[k][0]:
      w[i] = 1
  return w


def encode(
  t: Template, tok: Any, conversations: list[tuple[str, list[dict]]]
) -> list[tuple[list[int], np.ndarray]]:
  """(ids, weights) of each (where, messages) conversation, `tok` a jax3d HFTokenizer (its
  `tokenizers` object encodes with offsets). ValueError for a conversation with no supervised token."""
  rendered = [supervised_spans(t, messages, where) for where, messages in conversations]
  encodings = tok.tok.encode_batch([text for text, _ in rendered], add_special_tokens=False)
  out = []
  for (where, _), (_, spans), e in zip(conversations, rendered, encodings, strict=True):
    w = token_weights(e.offsets, spans)
    if not w.any():
      raise ValueError(f'{where}: the conversation has no supervised token (no assistant turn with text)')
    out.append((e.ids, w))
  return out
