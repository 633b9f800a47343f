"""Train the tiny default model shipped in course_pkg/models/tiny (a few CPU minutes).

Why train at all: a Qwen3 model with random weights at the usual init repeats one token
forever, which shows nothing about an engine. A ~1M-parameter model trained briefly on the
course's own prose (tools/tiny_model_corpus.txt, written for this project) produces readable,
varied text -- mostly recalled phrases of that prose, which is all a demo needs.

Everything is made with the libraries a real checkpoint is made with, so the folder is exactly
the Hugging Face format: a byte-level BPE tokenizer trained with ``tokenizers`` and wrapped in
``PreTrainedTokenizerFast``; the model is transformers' own ``Qwen3ForCausalLM``, written with
``save_pretrained`` (config.json with ``rope_parameters``, model.safetensors without
``lm_head.weight`` because the embeddings are tied).

Deterministic: fixed seeds, deterministic torch algorithms and one thread, so a rerun on the
same machine and library versions reproduces the same weights (float results may differ in
the last bits on other CPUs or versions).

    .venv/bin/python tools/train_tiny_model.py            # writes course_pkg/models/tiny
    .venv/bin/python tools/train_tiny_model.py --out DIR --steps 50
    .venv/bin/python tools/train_tiny_model.py --hybrid   # writes course_pkg/models/tiny_hybrid

``--hybrid`` trains the same model with local layers (chapter 16): layers 0 and 2 attend to a
sliding window of 32 positions, layers 1 and 3 to everything -- gpt-oss's 1:1 alternation,
Hugging Face's ``layer_types``. It is trained from scratch that way (same corpus, tokenizer,
seed and steps), not the full model with a window imposed afterwards.
"""
from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tools" / "tiny_model_corpus.txt"
OUT = ROOT / "course_pkg" / "models" / "tiny"
OUT_HYBRID = ROOT / "course_pkg" / "models" / "tiny_hybrid"
HYBRID_CONFIG = dict(use_sliding_window=True, sliding_window=32, max_window_layers=0,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
EOS = "<|endoftext|>"

MODEL_CONFIG = dict(
    hidden_size=128, intermediate_size=384, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    max_position_embeddings=2048, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=True, initializer_range=0.02,
)


def paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]


def train_tokenizer(docs: list[str], vocab_size: int):
    """Byte-level BPE (every string encodes; no unknown token), wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                   model_max_length=MODEL_CONFIG["max_position_embeddings"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--hybrid", action="store_true", help="local layers 0 and 2 (window 32)")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.out is None:
        args.out = OUT_HYBRID if args.hybrid else OUT

    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    docs = paragraphs(CORPUS.read_text(encoding="utf-8"))
    tokenizer = train_tokenizer(docs, args.vocab_size)
    eos_id = tokenizer.eos_token_id
    # One stream: every paragraph followed by the end-of-text token, so the model learns to stop.
    stream = []
    for doc in docs:
        stream += tokenizer.encode(doc) + [eos_id]
    data = torch.tensor(stream)
    print(f"corpus: {len(docs)} paragraphs, {len(stream)} tokens, vocab {len(tokenizer)}")

    config = Qwen3Config(vocab_size=len(tokenizer), eos_token_id=eos_id, pad_token_id=eos_id,
                         bos_token_id=None, **MODEL_CONFIG, **(HYBRID_CONFIG if args.hybrid else {}))
    config.dtype = torch.float32
    model = Qwen3ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    warmup = max(1, args.steps // 20)

    def lr_at(step):   # linear warmup, cosine decay to a tenth
        if step < warmup:
            return args.lr * (step + 1) / warmup
        t = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    # Windows start at random offsets, half of them at a paragraph start (what prompts look like).
    starts = [0] + [i + 1 for i, t in enumerate(stream[:-1]) if t == eos_id]
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    t0 = time.perf_counter()
    for step in range(args.steps):
        offsets = torch.randint(0, len(stream) - args.seq_len - 1, (args.batch_size,), generator=gen)
        para = torch.randint(0, len(starts), (args.batch_size // 2,), generator=gen)
        for j, p in enumerate(para.tolist()):
            offsets[j] = min(starts[p], len(stream) - args.seq_len - 1)
        batch = torch.stack([data[o:o + args.seq_len + 1] for o in offsets.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  ({time.perf_counter() - t0:.0f} s)")

    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("*"):
        old.unlink()
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(str(args.out))
    tokenizer.save_pretrained(str(args.out))
    print(f"wrote {args.out}")

    for prompt in ["The KV cache", "A block", "The scheduler", "Prefix caching"]:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=40, do_sample=False)
        print(repr(tokenizer.decode(out[0])))


if __name__ == "__main__":
    main()
