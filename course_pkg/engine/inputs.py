"""Prompts as vLLM takes them: text, token ids, or a dict that carries a ``cache_salt`` (chapter 12).

``{"prompt": "..."}`` is vLLM's ``TextPrompt`` and ``{"prompt_token_ids": [...]}`` its
``TokensPrompt``; either may add ``"cache_salt": "..."``. The salt keys the request's first
KV block (``BlockManager.compute_hash``), so requests share cached blocks only with requests
of the same salt: the defence against probing another user's prompt through the prefix cache.
"""
from __future__ import annotations

from typing import TypedDict



class _Salted(TypedDict, total=False):
    cache_salt: str              # optional: requests share cached blocks only within one salt


class TextPrompt(_Salted):
    prompt: str


class TokensPrompt(_Salted):
    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt

_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


def parse_prompt(prompt) -> tuple[object, str | None]:
    """``prompt`` -> (its text or token ids, its cache salt or ``None``); raises on a bad dict.

    Strings and lists pass through unchanged (their checks are ``LLMEngine.make_sequence``'s).
    A dict must hold exactly one of ``prompt`` / ``prompt_token_ids`` and nothing else but
    ``cache_salt`` (checked where every salt is, by ``Sequence``: a non-empty string).
    """
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = sorted(map(str, set(prompt) - _KEYS))
    if unknown:
        raise ValueError(f"unknown prompt field(s) {unknown}: a prompt dict holds 'prompt' or "
                         "'prompt_token_ids', and optionally 'cache_salt'")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict holds exactly one of 'prompt' (text) and 'prompt_token_ids', "
                         f"got keys {sorted(prompt)}")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise TypeError(f"'prompt' is text (a str), got {type(prompt['prompt']).__name__}: "
                            "pass token ids as 'prompt_token_ids'")
        content = prompt["prompt"]
    else:
        content = prompt["prompt_token_ids"]
        if isinstance(content, (str, bytes, bytearray)) or not isinstance(content, (list, tuple)):
            raise TypeError(f"'prompt_token_ids' is a list of ints, got {type(content).__name__}")
    return content, prompt.get("cache_salt")
