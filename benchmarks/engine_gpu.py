"""Our engine vs Hugging Face ``generate`` on a CUDA GPU, with the Qwen3-0.6B architecture.

    python benchmarks/engine_gpu.py                          # random Qwen3-0.6B weights, bf16
    python benchmarks/engine_gpu.py --model /path/to/Qwen3-0.6B
    python benchmarks/engine_gpu.py --smoke                  # tiny config on the CPU: checks the script

The workload follows Nano-vLLM's own benchmark: ``--num-seqs`` (256) requests with random
prompts of 100-1024 tokens and 100-1024 output tokens, ``ignore_eos``. Our engine runs it with
continuous batching, the Triton kernels (``attention_backend="auto"``) and a KV cache sized by
``gpu_memory_utilization``; Hugging Face runs it in static batches of ``--batch-size`` left-padded
prompts, each batch decoding until its longest output is done. Both decode greedily in bf16.
The script prints both throughputs and their ratio, measured side by side in one process.

Weights: a local checkpoint if ``--model`` is given or one is found in the Hugging Face cache;
otherwise seeded random weights at the Qwen3-0.6B shapes (speed does not depend on the values;
bf16 greedy outputs of two implementations drift apart, so only the first tokens are compared).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

# Decorate the Triton kernels before transformers imports triton on its own (loading a model
# imports torch._native.ops, which imports triton); see tests/test_engine.py.
import course_pkg.kernels.triton_kernels  # noqa: E402,F401

# Qwen3-0.6B's shapes (its config.json), for random weights when no checkpoint is at hand.
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                  initializer_range=0.02)
SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


def find_local_checkpoint() -> Path | None:
    """Qwen3-0.6B in the Hugging Face cache, if it was downloaded on this machine."""
    hub = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    for snapshot in sorted(hub.glob("models--Qwen--Qwen3-0.6B/snapshots/*")):
        if (snapshot / "config.json").is_file() and list(snapshot.glob("*.safetensors")):
            return snapshot
    return None


def make_workload(n, vocab, seed, lo, hi, out_lo, out_hi):
    rng = random.Random(seed)
    return [([rng.randrange(1, min(vocab, 10_000)) for _ in range(rng.randint(lo, hi))],
             rng.randint(out_lo, out_hi)) for _ in range(n)]


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_engine(path, workload, args):
    from course_pkg import LLM, SamplingParams
    llm = LLM(str(path), max_num_seqs=args.batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
              device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
              **({"num_kvcache_blocks": 256} if args.smoke else {}))
    # Warm up (Triton compiles its kernels on first launch) with a couple of short requests.
    llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]] * 2, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    sync()
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in workload], params, use_tqdm=False)
    sync()
    elapsed = time.perf_counter() - start
    m = llm.get_metrics()
    info = (f"{llm.model_runner.attention_backend} backend, {m.num_kvcache_blocks} KV blocks of "
            f"{llm.block_size} tokens ({llm.model_runner.kv_cache_bytes / 2**30:.1f} GiB), "
            f"{m.num_prefill_steps} prefill + {m.num_decode_steps} decode steps, {m.num_preemptions} preemptions")
    del llm
    __import__("gc").collect()           # free the KV cache before HF allocates its own
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [o.token_ids for o in outputs], elapsed, info


def run_hf(path, workload, args):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=args.dtype).to(args.device).eval()
    model.generation_config.eos_token_id = None
    pad = 0
    warm = torch.tensor([[1, 2, 3, 4]], device=args.device)
    model.generate(warm, attention_mask=torch.ones_like(warm), do_sample=False, max_new_tokens=4, pad_token_id=pad)
    outputs = []
    sync()
    start = time.perf_counter()
    for i in range(0, len(workload), args.batch_size):
        batch = workload[i:i + args.batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=args.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=args.device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                                 max_new_tokens=max(n for _, n in batch))
        outputs += [out[j, width:width + n].tolist() for j, (_, n) in enumerate(batch)]
    sync()
    return outputs, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="Qwen3 checkpoint folder (default: local Qwen3-0.6B, else random weights)")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-input", type=int, default=100)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--min-output", type=int, default=100)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=256, help="max sequences at once, both engines")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--skip-hf", action="store_true", help="time our engine only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, to check the script itself")
    args = ap.parse_args()
    if args.smoke:
        args.device, args.dtype = "cpu", torch.float32
        args.num_seqs, args.batch_size, args.max_model_len = 6, 4, 256
        args.min_input, args.max_input, args.min_output, args.max_output = 4, 40, 2, 12
        args.max_num_batched_tokens = 256
        args.attention_backend = "torch" if args.attention_backend == "auto" else args.attention_backend
    elif not torch.cuda.is_available():
        sys.exit("engine_gpu.py needs a CUDA GPU (try --smoke to check the script on a CPU)")
    else:
        args.device, args.dtype = "cuda", torch.bfloat16
        print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else (None if args.smoke else find_local_checkpoint())
        if path is None:
            from course_pkg.models import build_random_checkpoint
            fields = SMOKE if args.smoke else QWEN3_0_6B
            path = build_random_checkpoint(Path(tmp) / "qwen3", seed=args.seed, copy_tokenizer=False, **fields)
            print(f"model: random weights, {'smoke-test' if args.smoke else 'Qwen3-0.6B'} shapes")
        else:
            print(f"model: {path}")
        vocab = __import__("json").loads((path / "config.json").read_text())["vocab_size"]
        workload = make_workload(args.num_seqs, vocab, args.seed, args.min_input, args.max_input,
                                 args.min_output, args.max_output)
        num_in = sum(len(p) for p, _ in workload)
        num_out = sum(n for _, n in workload)
        print(f"workload: {len(workload)} requests, {num_in} input tokens ({args.min_input}-{args.max_input}), "
              f"{num_out} output tokens ({args.min_output}-{args.max_output}), ignore_eos, greedy")
        ours, t_ours, info = run_engine(path, workload, args)
        print(f"engine : {t_ours:8.2f} s  {num_out / t_ours:9.1f} output tok/s  ({info})")
        if args.skip_hf:
            return
        theirs, t_hf = run_hf(path, workload, args)
        print(f"HF     : {t_hf:8.2f} s  {num_out / t_hf:9.1f} output tok/s  "
              f"(static batches of {args.batch_size})")
        first = sum(a[:1] == b[:1] for a, b in zip(ours, theirs))
        same = sum(a == b for a, b in zip(ours, theirs))
        print(f"first greedy token equal for {first}/{len(workload)} requests; "
              f"whole outputs equal for {same}/{len(workload)}")
        print(f"throughput ratio engine / HF: {t_hf / t_ours:.2f}x")


if __name__ == "__main__":
    main()
