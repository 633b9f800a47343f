"""Chapter 13 grader: the output processor, ``AsyncLLM._process`` and ``_make_output``.

No engine runs: the grader plays the engine core. It makes the ``_Delta`` objects a step would
send -- token ids cut from real text by the tiny model's tokenizer (multi-byte characters
included), log-probabilities, finish reasons, an abort -- and feeds them to the processor under
test and to the package's, each with a fresh copy. The hand scenarios check the contract by what
a client sees (the pieces of a stream add up to the text, nothing a stop string cuts is ever
sent, the engine is told to stop a finished completion); the random streams compare every output
and every command with the package's, delta by delta.
"""
from __future__ import annotations

import asyncio
import queue
import random
from functools import lru_cache

from course_pkg.labs.lab import Grading

WORDS = ["The", " block", " manager", " keeps", " the", " pool", ",", " naïve", " café", " 日本", " 🙂",
         " prefix", " cache", " hit", " au", " lait", "."]


@lru_cache(maxsize=1)
def _tokenizer():
    from course_pkg.models import default_model_path, load_tokenizer
    return load_tokenizer(default_model_path())


@lru_cache(maxsize=1)
def _loop():
    return asyncio.new_event_loop()      # RequestState's queue and future need one; it never runs


def _processor(cls):
    """An instance of ``cls`` (an AsyncLLM class) with only what the output processor uses: no engine."""
    p = cls.__new__(cls)
    p.tokenizer = _tokenizer()
    p._commands = queue.SimpleQueue()
    return p


def _state(n: int = 1, stop=(), kind="DELTA"):
    from course_pkg.engine.async_llm import RequestOutputKind, RequestState
    from course_pkg.sampling_params import SamplingParams

    state = RequestState("req", "a prompt", SamplingParams(n=n), tuple(stop), RequestOutputKind[kind], _loop())
    state.seq_prompt_ids = [11, 12, 13]
    return state


def _delta(tokens: dict, reasons: dict | None = None, finished: bool = False, logprobs: dict | None = None,
           cached: int = 0):
    from course_pkg.engine.async_llm import _Delta
    logprobs = logprobs or {i: [-0.5] * len(t) for i, t in tokens.items()}
    return _Delta(new_token_ids=tokens, new_logprobs=logprobs, finish_reasons=reasons or {}, num_prompt_tokens=3,
                  num_cached_tokens=cached, metrics=None, finished=finished)


def _fresh(d):
    """A copy of delta ``d`` with lists and dicts of its own (``copy.deepcopy`` would leave a
    ``__slotnames__`` cache on the package's class, which the command line's watch refuses)."""
    from course_pkg.engine.async_llm import _Delta
    return _Delta(new_token_ids={i: list(t) for i, t in d.new_token_ids.items()},
                  new_logprobs={i: list(lp) for i, lp in d.new_logprobs.items()},
                  finish_reasons=dict(d.finish_reasons), num_prompt_tokens=d.num_prompt_tokens,
                  num_cached_tokens=d.num_cached_tokens, metrics=d.metrics, finished=d.finished)


def _encode(text: str) -> list[int]:
    return _tokenizer().encode(text, add_special_tokens=False)


def _commands(p) -> list[tuple]:
    out = []
    while True:
        try:
            out.append(p._commands.get_nowait())
        except queue.Empty:
            return out


def _view(out):
    """What a caller sees of an output."""
    if out is None:
        return None
    return (out.request_id, out.prompt, tuple(out.prompt_token_ids), out.num_cached_tokens, out.finished,
            out.metrics is not None,
            tuple((o.index, o.text, tuple(o.token_ids), round(o.cumulative_logprob, 9), o.finish_reason,
                   None if o.logprobs is None else tuple(o.logprobs), o.stop_reason) for o in out.outputs))


def _run(g: Grading, p, state, deltas):
    """Feed ``deltas`` to ``p``; return the outputs handed out (None left out) and the commands."""
    outs, commands = [], []
    for d in deltas:
        out = p._process(state, _fresh(d))
        for name, arg in _commands(p):
            g.check(isinstance(arg, tuple) and arg[0] is state,
                    f"the command {name!r} names its request's state (the command's argument is {arg!r})")
            commands.append((name, list(arg[1])))
        if out is not None:
            outs.append(out)
    return outs, commands


def _joined(outs, index: int = 0) -> str:
    return "".join(o.text for out in outs for o in out.outputs if o.index == index)


def grade_output_processor(impl, g: Grading) -> None:
    sentence = "The block manager keeps the pool"
    ids = _encode(sentence)
    with g.scenario("DELTA: the pieces of a stream add up to the text, each token handed out once"):
        p, state = _processor(impl), _state()
        steps = [ids[:2], ids[2:3], ids[3:]]
        deltas = [_delta({0: t}) for t in steps[:-1]] + [_delta({0: steps[-1]}, {0: "length"}, finished=True)]
        outs, _ = _run(g, p, state, deltas)
        g.equal(_joined(outs), sentence, "the texts of the DELTA outputs, joined")
        g.equal([t for out in outs for t in out.outputs[0].token_ids], ids, "their token ids, joined")
        g.equal([out.finished for out in outs][-1:], [True], "the last output's finished")
        g.equal(outs[-1].outputs[0].finish_reason, "length", "the last output's finish_reason (the engine's)")
        g.equal(state.finished, True, "state.finished after the engine's finish")
        g.equal(outs[0].prompt_token_ids, [11, 12, 13], "prompt_token_ids (from state.seq_prompt_ids)")
    with g.scenario("a character whose bytes span two tokens is never handed out half-decoded"):
        text = " naïve café 日本 🙂"
        pieces = _encode(text)
        p, state = _processor(impl), _state()
        deltas = [_delta({0: [t]}) for t in pieces[:-1]] + [_delta({0: pieces[-1:]}, {0: "length"}, finished=True)]
        outs, _ = _run(g, p, state, deltas)
        sent = [out.outputs[0].text for out in outs]
        g.check(not any("\ufffd" in s for s in sent), f"a DELTA text held U+FFFD (half a character): {sent}")
        g.equal(_joined(outs), text, "the texts of the DELTA outputs, joined")
    with g.scenario("a stop string that arrives over three steps: the text is cut before it, nothing of it is sent"):
        text = " naïve café au lait."
        pieces = _encode(text)
        p, state = _processor(impl), _state(stop=(" au l",))
        deltas = [_delta({0: [t]}) for t in pieces]
        outs, commands = _run(g, p, state, deltas)
        g.equal(_joined(outs), " naïve café", "the texts of the DELTA outputs, joined")
        g.equal((outs[-1].outputs[0].finish_reason, outs[-1].outputs[0].stop_reason), ("stop", " au l"),
                "the last output's (finish_reason, stop_reason)")
        g.equal(state.finished, True, "state.finished once the only completion stopped")
        g.equal(commands, [], "commands: none (the request is finished; the caller aborts it in the engine)")
    with g.scenario("n=2: completion 0 stops on its string, completion 1 goes on, and the engine is told"):
        a, b = _encode(" naïve café au lait"), _encode(" the prefix cache hit")
        p, state = _processor(impl), _state(n=2, stop=(" au",))
        cut = next(k for k in range(1, len(a) + 1) if " au" in _tokenizer().decode(a[:k]))
        deltas = [_delta({0: a[k:k + 1], 1: b[k:k + 1]}) for k in range(cut + 1)]   # one token past the stop
        deltas += [_delta({1: b[cut + 1:]}, {1: "length"}, finished=True)]
        outs, commands = _run(g, p, state, deltas)
        g.equal(commands, [("stop_completions", [0])], "the commands sent to the engine")
        g.equal(_joined(outs, 0), " naïve café", "completion 0's text")
        g.equal(_joined(outs, 1), " the prefix cache hit", "completion 1's text")
        zero = [t for out in outs for o in out.outputs if o.index == 0 for t in o.token_ids]
        g.equal(zero, a[:cut], "completion 0's tokens (none after the one that completed its stop string)")
        g.equal([out.finished for out in outs].count(True), 1, "outputs with finished=True")
    with g.scenario("the engine aborts a request: every unfinished completion ends with 'abort'"):
        p, state = _processor(impl), _state(n=2)
        deltas = [_delta({0: ids[:3], 1: ids[:2]}), _delta({0: ids[3:4]}, {0: "length"}),
                  _delta({}, {}, finished=True)]
        outs, _ = _run(g, p, state, deltas)
        reasons = {o.index: o.finish_reason for out in outs for o in out.outputs if o.finish_reason}
        g.equal(reasons, {0: "length", 1: "abort"}, "the finish reasons handed out")
        g.equal(state.finished, True, "state.finished after the abort")
    with g.scenario("CUMULATIVE: every output holds all that is settled so far"):
        p, state = _processor(impl), _state(kind="CUMULATIVE")
        deltas = [_delta({0: [t]}) for t in ids[:-1]] + [_delta({0: ids[-1:]}, {0: "length"}, finished=True)]
        outs, _ = _run(g, p, state, deltas)
        g.equal(outs[-1].outputs[0].text, sentence, "the last output's text")
        g.equal(outs[-1].outputs[0].token_ids, ids, "the last output's token ids")
        texts = [out.outputs[0].text for out in outs]
        g.check(all(sentence.startswith(t) for t in texts) and texts == sorted(texts, key=len),
                f"each CUMULATIVE text extends the one before: {texts}")
        g.equal(round(outs[-1].outputs[0].cumulative_logprob, 6), round(-0.5 * len(ids), 6), "cumulative_logprob")
    with g.scenario("FINAL_ONLY: one output, when the request has finished"):
        p, state = _processor(impl), _state(kind="FINAL_ONLY")
        deltas = [_delta({0: [t]}) for t in ids[:-1]] + [_delta({0: ids[-1:]}, {0: "length"}, finished=True)]
        outs, _ = _run(g, p, state, deltas)
        g.equal([(out.finished, out.outputs[0].text) for out in outs], [(True, sentence)], "the outputs")
    with g.scenario("300 random streams in lockstep with the package's processor (kinds, n, stop strings, aborts)"):
        from course_pkg.engine.async_llm import AsyncLLM
        rng = random.Random(13)
        for trial in range(300):
            kind = rng.choice(["DELTA", "DELTA", "CUMULATIVE", "FINAL_ONLY"])
            n = rng.choice([1, 1, 2])
            texts = ["".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))) for _ in range(n)]
            streams = [_encode(t) for t in texts]
            stop = tuple(rng.sample(_candidate_stops(rng, texts[0]), rng.randint(0, 2)))
            deltas = _random_deltas(rng, streams)
            mine, ref = _processor(impl), _processor(AsyncLLM)
            s_mine, s_ref = _state(n, stop, kind), _state(n, stop, kind)
            for step, d in enumerate(deltas):
                got = mine._process(s_mine, _fresh(d))
                want = ref._process(s_ref, _fresh(d))
                where = (f"stream {trial} ({kind}, n={n}, stop={stop!r}, texts={texts!r}), delta {step} "
                         f"{d.new_token_ids}, finished={d.finished}")
                g.equal(_view(got), _view(want), f"{where}: the output")
                g.equal([(c, list(a[1])) for c, a in _commands(mine)], [(c, list(a[1])) for c, a in _commands(ref)],
                        f"{where}: the commands to the engine")
                g.equal(s_mine.finished, s_ref.finished, f"{where}: state.finished")


def _candidate_stops(rng: random.Random, text: str) -> list[str]:
    """Stop strings to try: pieces of the text (1-5 characters) and one it does not contain."""
    found = []
    for _ in range(3):
        if len(text) > 2:
            i = rng.randrange(1, len(text) - 1)
            found.append(text[i:i + rng.randint(1, 5)])
    return found + ["zzz"]


def _random_deltas(rng: random.Random, streams: list[list[int]]):
    """The deltas of one random run: tokens in steps of 0-3 per completion; each completion ends
    with "length" when its tokens run out, or the engine aborts the request part-way."""
    pos = [0] * len(streams)
    abort_at = rng.choice([None, None, None, rng.randint(1, 6)])
    deltas, step = [], 0
    while True:
        step += 1
        tokens, reasons, lps = {}, {}, {}
        for i, s in enumerate(streams):
            if pos[i] >= len(s):
                continue
            k = rng.randint(0, 3)
            tokens[i] = s[pos[i]:pos[i] + k]
            lps[i] = [round(rng.uniform(-3, 0), 3) for _ in tokens[i]]
            pos[i] += len(tokens[i])
            if pos[i] >= len(s):
                reasons[i] = "length"
        done = all(p >= len(s) for p, s in zip(pos, streams))
        if abort_at is not None and step >= abort_at:
            deltas.append(_delta(tokens, {}, finished=True, logprobs=lps, cached=4))
            return deltas
        deltas.append(_delta(tokens, reasons, finished=done, logprobs=lps, cached=4))
        if done:
            return deltas
