"""The request bodies the server accepts, as pydantic models (OpenAI's field names).

Every model forbids unknown fields and converts nothing (``strict``): ``"max_tokens": "5"`` or a
field this server does not know (``presence_penalty``, ``frequency_penalty``, ``logit_bias``: the
sampler has no penalties or biases) is a 400 that names the field, never a
value silently dropped or misread. That is this course's choice, not vLLM's: vLLM's
``OpenAIBaseModel`` allows extra fields (``extra="allow"``) and only logs the ones it ignores;
the issue behind chapter 13 asks for a 400 instead. ``None`` stands for "not given" as in
OpenAI's API. ``ignore_eos`` and ``return_tokens_as_token_ids`` are vLLM's extensions of the
API (benchmarks use the first for fixed lengths; the tests use the second to compare token ids
exactly).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class SamplingFields(OpenAIBaseModel):
    """The fields completions and chat completions share."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    return_tokens_as_token_ids: bool | None = False   # vLLM's: logprobs name tokens "token_id:<id>"
    cache_salt: str | None = None   # chapter 12 (vLLM's field): share cached blocks only within one salt


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int]
    max_tokens: int | None = Field(default=16, ge=1)    # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=5)


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: messages rendered by the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)             # None: up to the context's end
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for it
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
