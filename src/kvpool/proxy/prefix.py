"""A request's prefix chain, from its body: what the routing policies compare.

The proxy does not tokenize. It hashes what the client sent, so that two requests whose
prompts start alike get chains that start alike (``kvpool.routing``):

- ``prompt`` as token ids (a list of ints): :func:`kvpool.routing.token_chain` over blocks of
  ``--routing-block-size`` tokens (kind ``"tokens"``);
- ``prompt`` as text: :func:`kvpool.routing.text_chain` over blocks of ``--routing-block-chars``
  characters (kind ``"text"``);
- a batch (``prompt`` a list of strings or of token-id lists): the first prompt's chain, as the
  whole batch goes to one instance;
- ``messages`` (chat): ``text_chain`` over the messages serialized one after the other, each as
  its role and its content (text parts as they are, other parts as compact JSON). A later turn
  of a conversation repeats the earlier messages and adds some, so its text starts with the
  earlier turn's, as the prompt the chat template renders starts with the earlier prompt.

Anything else (no prompt, token ids out of range) has an empty chain: the policy then routes
by load alone. Only the first :data:`MAX_BLOCKS` blocks are hashed, to bound the proxy's work
per request.
"""

from __future__ import annotations

import json
from typing import Any

from kvpool.routing import text_chain, token_chain

# Leading blocks hashed per request: 256 blocks of 128 tokens is a 32K-token prefix, past any
# shared system prompt, so two conversations on one long document still differ in their chains.
MAX_BLOCKS = 256
# Between two serialized chat messages and between a role and its content: characters a
# message's own text is unlikely to hold, so one message cannot pass for two.
_SEP = "\x1e"
_ROLE_SEP = "\x1f"

KINDS = ("tokens", "text", "none")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                out.append(json.dumps(part, sort_keys=True, separators=(",", ":"), ensure_ascii=False))
        return "".join(out)
    if content is None:
        return ""
    return json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def chat_text(messages: list[Any]) -> str:
    """The text a chat's chain is computed over (see the module docstring)."""
    out = []
    for m in messages:
        if isinstance(m, dict):
            out.append(f"{m.get('role', '')}{_ROLE_SEP}{_content_text(m.get('content'))}{_SEP}")
        else:
            out.append(_content_text(m) + _SEP)
    return "".join(out)


def request_chain(body: dict[str, Any], block_tokens: int, block_chars: int) -> tuple[str, list[int]]:
    """(kind, chain) of a completion or chat request body; kind is one of :data:`KINDS`."""
    try:
        if "messages" in body and isinstance(body["messages"], list):
            return "text", text_chain(chat_text(body["messages"]), block_chars, MAX_BLOCKS)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not _is_token_ids(prompt):
            prompt = prompt[0]  # a batch: its first prompt
        if _is_token_ids(prompt):
            return "tokens", token_chain(prompt, block_tokens, MAX_BLOCKS)
        if isinstance(prompt, str):
            return "text", text_chain(prompt, block_chars, MAX_BLOCKS)
    except (OverflowError, ValueError, TypeError):  # e.g. a token id past int64: the instance will say 400
        pass
    return "none", []
