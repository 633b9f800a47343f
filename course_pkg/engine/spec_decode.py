"""Speculative decoding (chapter 14): guess k tokens cheaply, let the model check them in one pass.

A decode step computes one token per sequence, and on a GPU that step is memory-bound: the
weights are read once whether the step computes 1 token or 5. Speculative decoding spends the
idle arithmetic. A cheap *proposer* guesses the next ``k`` tokens (the *drafts*); the target
model computes the sequence's last token and the ``k`` drafts in one forward pass, which gives
its own next-token distribution after each of them; the drafts are accepted from the left as
long as the target agrees, and the first disagreement is replaced by the target's own token.
A step so yields between 1 and ``k + 1`` tokens, and -- the point -- exactly the tokens the
target would have produced alone: token for token when greedy, in distribution when sampling
(rejection sampling, Leviathan et al. 2023; Chen et al. 2023).

The pieces (vLLM's names where vLLM has the thing):

* :class:`SpeculativeConfig` -- ``LLM(speculative_config={...})``:
  ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}``
  takes vLLM's keys and means what they mean there;
  ``{"method": "early_exit", "num_speculative_tokens": k, "num_draft_layers": 2}`` is this
  course's own method and key (vLLM's ``"draft_model"`` is a separate, smaller checkpoint with
  a KV cache of its own, which this course does not build).
* :class:`NgramProposer` -- prompt lookup decoding (Saxena 2023): no model at all; find the
  longest recent n-gram earlier in the sequence and propose what followed it there.
* :class:`EarlyExitProposer` -- the target's own first ``num_draft_layers`` layers, its final
  norm and its LM head: an early exit, self-speculation as in LayerSkip (Draft & Verify, the
  other self-speculative design, skips intermediate layers instead). It needs no second
  checkpoint and no second KV cache: the draft's K/V in those layers are the target's, so it
  reads the cache the target wrote and writes its drafts' K/V into the lookahead slots, which
  verification then overwrites.
* :func:`greedy_accept` and :func:`rejection_sample` -- the acceptance rules, pure functions.
* ``scheduler.SpecDecodingStats`` -- ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
  ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``; the mean acceptance length
  (kept by the torch-free Scheduler, which records each step's results).

The block side (the lookahead slots, the rollback) is the Scheduler's and the BlockManager's:
``Scheduler._schedule_lookahead``, ``BlockManager.allocate_lookahead_slots`` and
``BlockManager.free_lookahead_slots``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from course_pkg.validation import check_choice, check_int

SPECULATIVE_METHODS = ("ngram", "early_exit")
_KEYS = {"ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"},
         "early_exit": {"method", "num_speculative_tokens", "num_draft_layers"}}
_NOT_BUILT = {"draft_model": "vLLM's 'draft_model' drafts with a separate, smaller checkpoint, which needs a KV "
                             "cache of its own; this course drafts with the target's own first layers, "
                             "method 'early_exit' (with 'num_draft_layers')"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """What ``LLM(speculative_config={...})`` asks for, checked.

    ``num_speculative_tokens``: drafts per step (k), as in vLLM's ``SpeculativeConfig``.
    ``ngram`` (vLLM's method and keys): ``prompt_lookup_max`` and ``prompt_lookup_min`` bound
    the n-gram that is looked up (vLLM's defaults: one given sets the other; neither given
    means 5 and 5). ``early_exit`` (this course's method and key, not vLLM's): the drafts come
    from the target's first ``num_draft_layers`` layers (default: half of them, at least one).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    num_draft_layers: int | None = None

    @classmethod
    def from_dict(cls, value) -> "SpeculativeConfig":
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                            f"'num_speculative_tokens': 3}}, got {type(value).__name__}")
        if "method" not in value:
            raise ValueError(f"speculative_config needs a 'method', one of {SPECULATIVE_METHODS}")
        if value["method"] in _NOT_BUILT:
            raise ValueError(f"speculative_config: method {value['method']!r} is not built here: "
                             f"{_NOT_BUILT[value['method']]}")
        method = check_choice("speculative_config['method']", value["method"], SPECULATIVE_METHODS)
        unknown = set(value) - _KEYS[method]
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {sorted(unknown)} for method {method!r}; "
                             f"the keys are {sorted(_KEYS[method])}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'num_speculative_tokens' (the drafts per step, k >= 1)")
        k = check_int("speculative_config['num_speculative_tokens']", value["num_speculative_tokens"], minimum=1)
        if method == "ngram":
            lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
            if lo is None and hi is None:
                lo = hi = 5
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            check_int("speculative_config['prompt_lookup_min']", lo, minimum=1)
            check_int("speculative_config['prompt_lookup_max']", hi, minimum=1)
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min={lo} is more than prompt_lookup_max={hi}")
            return cls(method, k, prompt_lookup_max=hi, prompt_lookup_min=lo)
        layers = value.get("num_draft_layers")
        if layers is not None:
            check_int("speculative_config['num_draft_layers']", layers, minimum=1)
        return cls(method, k, num_draft_layers=layers)

    def check_against_model(self, model_config) -> "SpeculativeConfig":
        """The rules that need the target's checkpoint; returns the config with its defaults filled in."""
        if self.method != "early_exit":
            return self
        total = model_config.num_hidden_layers
        layers = self.num_draft_layers if self.num_draft_layers is not None else max(1, total // 2)
        if not 1 <= layers < total:
            raise ValueError(f"speculative_config['num_draft_layers']={layers}: the draft must use fewer layers "
                             f"than the target's {total} (and at least 1)")
        return SpeculativeConfig(self.method, self.num_speculative_tokens, num_draft_layers=layers)


# ---------------------------------------------------------------- proposers


class NgramProposer:
    """Prompt lookup decoding: the tokens that followed the latest n-gram's earlier occurrence.

    The last ``n`` tokens, for ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``,
    are searched for earlier in the sequence (prompt and generated tokens); at the first ``n``
    that occurs, the earliest occurrence wins (as in vLLM's ``NgramProposer``), and up to ``k``
    tokens that followed it are proposed. No match: no drafts. Torch-free and stateless.
    """

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        num_tokens = len(token_ids)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            suffix = token_ids[num_tokens - n:]
            for start in range(num_tokens - n):   # every earlier position, the suffix itself excluded
                if token_ids[start:start + n] == suffix:
                    return token_ids[start + n:start + n + k]
        return []


class EarlyExitProposer:
    """Drafts with the target's first ``num_layers`` layers, its final norm and its LM head.

    One pass per draft, over every speculating sequence at once: pass ``i`` feeds token
    ``i`` of ``[last token, d_1, ..., d_{k-1}]``, writes its K/V in those layers into the
    sequence's slot for it (the lookahead slots) and reads the cache the target wrote for the
    earlier tokens -- the same weights on the same tokens give the same K/V, so the draft needs
    no cache of its own. Greedy requests draft greedily; sampled ones sample their draft from
    the draft's distribution ``q`` (the request's temperature and top-p), which rejection
    sampling needs.
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers


# ---------------------------------------------------------------- acceptance


def greedy_accept(draft_token_ids: list[int], target_token_ids: list[int]) -> list[int]:
    """The tokens a greedy step yields: the drafts up to the first that differs from the target's
    arg-max, then the target's own token there (or, all accepted, the bonus token after them).

    ``target_token_ids[i]`` is the target's arg-max after the last token and ``i`` drafts
    (``len(draft_token_ids) + 1`` of them). The result is exactly what ``len(result)`` steps of
    plain greedy decoding produce.
    """
    out = []
    for draft, target in zip(draft_token_ids, target_token_ids):
        out.append(target)
        if draft != target:
            return out
    out.append(target_token_ids[len(draft_token_ids)])
    return out


def rejection_sample(draft_token_ids: list[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> list[int]:
    """The tokens a sampled step yields, distributed exactly as sampling the target alone.

    ``target_probs``: ``[k + 1, V]``, the target's distribution after the last token and after
    each of the ``k`` drafts. ``draft_probs``: ``[k, V]``, the distribution ``q`` each draft was
    sampled from, or None for a deterministic proposer (n-gram: ``q`` is all on the draft). Draft
    ``x`` is accepted with probability ``min(1, p(x) / q(x))``; the first rejected one is replaced
    by a sample of the residual ``max(0, p - q)`` renormalised; with every draft accepted, a
    bonus token is drawn from the last row of ``p``. (Leviathan et al. 2023, Algorithm 1.)

    With a certain draft (``draft_probs`` None) the rule is run in an equivalent form: the
    target's token is sampled at each position, as plain decoding samples it (one draw of
    ``generator`` per token the step yields), and the draft is accepted when it is that token.
    It is accepted with probability ``p(x)``, and otherwise the token is ``p`` given that it is
    not ``x`` -- the residual ``max(0, p - q)`` renormalised, as Algorithm 1 asks. So a seeded
    request draws exactly what it draws without speculation and yields the same tokens, however
    many drafts it was given. With a sampled draft the draws do depend on the drafts (a ``u`` per
    verified draft, and the draft's own samples): same distribution, different tokens.
    """
    k = len(draft_token_ids)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"{k} drafts need {k + 1} rows of target probabilities, got {target_probs.shape[0]}")
    device = target_probs.device
    out = []
    if draft_probs is None:    # a certain draft: accepted iff it is the target's own sample
        for i, x in enumerate(draft_token_ids):
            y = _sample(target_probs[i], generator)
            out.append(y)
            if y != x:
                return out
        out.append(_sample(target_probs[k], generator))
        return out
    for i, x in enumerate(draft_token_ids):
        p, q = target_probs[i], draft_probs[i]
        u = torch.rand((), generator=generator, device=device)
        if u * q[x] < p[x]:        # u < p(x) / q(x), without dividing (q(x) > 0: x was drawn from q)
            out.append(x)
            continue
        residual = torch.clamp(p - q, min=0.0)
        if not residual.sum() > 0:   # p and q equal up to float32 rounding: nothing left over, sample p
            residual = p
        out.append(_sample(residual, generator))
        return out
    out.append(_sample(target_probs[k], generator))
    return out


def _sample(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token drawn with probability proportional to ``weights`` (the sampler's exponential race:
    one ``Exp(1)`` draw per token id, as ``Sampler`` draws for a plain decode)."""
    noise = torch.empty_like(weights).exponential_(generator=generator).clamp_min_(1e-30)
    return int((weights / noise).argmax())
