"""Which characters of a rendered chat are assistant replies (trained on), anchored by construction.

The conversation is rendered twice: once as is, and once with each message's content replaced
by a unique sentinel. In the sentinel render, everything outside the sentinels is exactly the
template's own text (role headers, end-of-turn markers, empty <think> blocks), and each
message's position is where its sentinel is: nothing is searched for, so a reply such as "a"
or "start" can never be found inside the markup (`<|im_st[a]rt|>`). The real render must then
equal the sentinel render with each sentinel replaced by the message's content (as the
template left it: as is, or stripped); if it does not, the template rewrote or dropped
content, and the row is counted under its own reason rather than trained on with guessed
labels.

Where the template marks replies with `{% generation %}`, transformers computes the mask
itself (apply_chat_template(..., return_assistant_tokens_mask=True)) and that is used instead.

Token rule (both paths use it in the tests): a token is trained on when its first character
lies inside an assistant span. The span of a reply is its content plus the end-of-turn
token that closes it, since the model must learn to stop.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
SENTINEL = "\ue000FTIMAGE{}\ue001"   # private-use code points: never produced by a real chat row
# How templates commonly transform content before printing it; tried in this order.
TRANSFORMS = (lambda c: c, str.strip, lambda c: c.lstrip("\n"), str.rstrip, str.lstrip)


class Unmaskable(Exception):
    """The assistant spans of a row cannot be located unambiguously; `reason` is its bad-row reason."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail or reason)
        self.reason = reason


@dataclass(frozen=True)
class Rendered:
    text: str
    spans: tuple[tuple[int, int], ...]   # character spans trained on, in order


def has_generation_tags(template: str | None) -> bool:
    return bool(template and GENERATION_TAG.search(template))


def special_texts(tokenizer) -> tuple[str, ...]:
    """Texts that would render as real special tokens if they appeared in content."""
    texts = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values():
        if getattr(token, "special", False):
            texts.add(str(token.content))
    return tuple(sorted((t for t in texts if t), key=len, reverse=True))


def render_with_spans(tokenizer, messages: list[dict], eot: str) -> Rendered:
    """The rendered chat and the character spans of each assistant reply (+ its end of turn)."""
    specials = special_texts(tokenizer)
    for m in messages:
        for text in specials:
            if text in m["content"]:
                raise Unmaskable("content_has_special_token", f"{text!r} in a {m['role']} message")
    real = tokenizer.apply_chat_template(messages, tokenize=False)
    marked = [{**m, "content": SENTINEL.format(i)} for i, m in enumerate(messages)]
    skeleton = tokenizer.apply_chat_template(marked, tokenize=False)
    parts = re.split("(" + re.escape(SENTINEL).replace("\\{\\}", r"\d+") + ")", skeleton)
    # parts alternate: template text, sentinel, template text, sentinel, ..., template text
    sentinels = parts[1::2]
    order = [int(re.search(r"\d+", s).group()) for s in sentinels]
    if order != list(range(len(messages))):
        raise Unmaskable("template_dropped_message", f"rendered messages {order}, expected {len(messages)}")
    pos, spans = 0, []
    for i, message in enumerate(messages):
        before, after = parts[2 * i], parts[2 * i + 2]
        if not real.startswith(before, pos):
            raise Unmaskable("template_rewrote_content", f"the template text before message {i} differs")
        pos += len(before)
        content = _match_content(real, pos, message["content"], after, last=i == len(messages) - 1)
        start, pos = pos, pos + len(content)
        if message["role"] == "assistant":
            end = pos
            rest = real[pos:]
            gap = len(rest) - len(rest.lstrip())
            if eot and real.startswith(eot, pos + gap):
                end = pos + gap + len(eot)
            spans.append((start, end))
    if real[pos:] != parts[-1]:
        raise Unmaskable("template_rewrote_content", "the template text after the last message differs")
    return Rendered(text=real, spans=tuple(spans))


def _match_content(real: str, pos: int, content: str, after: str, last: bool) -> str:
    for transform in TRANSFORMS:
        candidate = transform(content)
        if real.startswith(candidate, pos) and (real.startswith(after, pos + len(candidate))
                                                 or (last and real[pos + len(candidate):] == after)):
            return candidate
    raise Unmaskable("template_rewrote_content", "a message's content does not appear where the template put it")


def render_tagged(tokenizer, messages: list[dict]) -> Rendered:
    """Generation-tagged templates: the rendered chat and transformers' own generation spans
    (the character spans apply_chat_template(..., return_assistant_tokens_mask=True) masks)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, indices = render_jinja_template(conversations=[messages], chat_template=tokenizer.chat_template,
                                              return_assistant_tokens_mask=True,
                                              **getattr(tokenizer, "special_tokens_map", {}))
    return Rendered(text=rendered[0], spans=tuple((int(a), int(b)) for a, b in indices[0]))


def render(tokenizer, messages: list[dict], eot: str) -> Rendered:
    """The one entry point: transformers' generation spans when the template has them, else the
    anchored sentinel render. Special-token text in content is refused on both paths."""
    if has_generation_tags(tokenizer.chat_template):
        for m in messages:
            for text in special_texts(tokenizer):
                if text in m["content"]:
                    raise Unmaskable("content_has_special_token", f"{text!r} in a {m['role']} message")
        return render_tagged(tokenizer, messages)
    return render_with_spans(tokenizer, messages, eot)
