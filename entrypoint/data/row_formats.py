"""Row layouts, as axolotl and TRL users have their data, mapped to one shape before masking.

  messages           {messages: [{role, content, reasoning_content?}]}     (ultrachat_200k, TRL)
  sharegpt           {conversations: [{from: human|gpt|system|tool, value}]}
  alpaca             {instruction, input, output}: one user turn (instruction, then a blank line and
                     the input when it is not empty) and one assistant turn
  text               {text}: the whole text is trained (and the end-of-sequence token after it)
  prompt_completion  {prompt, completion}: only the completion is trained; each is a string, or a
                     list of messages (TRL's conversational form)

Chat rows become a list of messages for the chat template; plain rows (text, string
prompt/completion) become text with the character spans to train. Each problem is a bad-row
reason, counted, never trained on silently.
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEMAS = ("messages", "sharegpt", "alpaca", "text", "prompt_completion")
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function_response": "tool"}


class BadRow(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Chat:
    messages: list[dict]


@dataclass(frozen=True)
class Plain:
    prompt: str            # not trained
    completion: str        # trained, followed by the end-of-sequence token


def _text(value, reason: str) -> str:
    if not isinstance(value, str):
        raise BadRow(reason)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:   # a lone surrogate ("\\ud800" in the JSON) cannot be tokenized
        raise BadRow("undecodable_text") from None
    return value


def clean_messages(messages, max_messages: int) -> list[dict]:
    if messages is None:
        raise BadRow("missing_messages")
    if not isinstance(messages, list):
        raise BadRow("messages_not_a_list")
    if not messages:
        raise BadRow("empty_messages")
    if len(messages) > max_messages:
        raise BadRow("too_many_messages")
    clean = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRow("malformed_message")
        if m["role"] not in ROLES:
            raise BadRow("unknown_role")
        content = _text(m["content"], "malformed_message")
        if not content.strip():
            raise BadRow("empty_content")
        item = {"role": m["role"], "content": content}
        reasoning = m.get("reasoning_content")
        if reasoning is not None:
            reasoning = _text(reasoning, "malformed_message")
            if m["role"] != "assistant":
                raise BadRow("reasoning_not_from_assistant")
            if reasoning.strip():
                item["reasoning_content"] = reasoning
        clean.append(item)
    if not any(m["role"] == "assistant" for m in clean):
        raise BadRow("no_assistant_turn")
    return clean


def convert(row, schema: str, *, messages_field: str = "messages", max_messages: int = 4096) -> Chat | Plain:
    """A row of `schema` as a Chat or a Plain; BadRow(reason) when it is not one."""
    if not isinstance(row, dict):
        raise BadRow("not_an_object")
    if schema == "messages":
        return Chat(clean_messages(row.get(messages_field), max_messages))
    if schema == "sharegpt":
        turns = row.get("conversations")
        if not isinstance(turns, list):
            raise BadRow("missing_conversations")
        messages = []
        for turn in turns:
            if not isinstance(turn, dict) or not isinstance(turn.get("from"), str):
                raise BadRow("malformed_message")
            role = SHAREGPT_ROLES.get(turn["from"])
            if role is None:
                raise BadRow("unknown_role")
            messages.append({"role": role, "content": turn.get("value")})
        return Chat(clean_messages(messages, max_messages))
    if schema == "alpaca":
        instruction = _text(row.get("instruction"), "missing_instruction")
        extra = row.get("input") or ""
        extra = _text(extra, "malformed_input")
        output = _text(row.get("output"), "missing_output")
        user = instruction + (f"\n\n{extra}" if extra.strip() else "")
        return Chat(clean_messages([{"role": "user", "content": user}, {"role": "assistant", "content": output}],
                                   max_messages))
    if schema == "text":
        text = _text(row.get("text"), "missing_text")
        if not text.strip():
            raise BadRow("empty_content")
        return Plain(prompt="", completion=text)
    if schema == "prompt_completion":
        prompt, completion = row.get("prompt"), row.get("completion")
        if isinstance(prompt, list) and isinstance(completion, list):   # TRL's conversational form
            return Chat(clean_messages(prompt + completion, max_messages))
        prompt = _text(prompt, "missing_prompt")
        completion = _text(completion, "missing_completion")
        if not completion.strip():
            raise BadRow("empty_content")
        return Plain(prompt=prompt, completion=completion)
    raise ValueError(f"unknown schema {schema!r}")
