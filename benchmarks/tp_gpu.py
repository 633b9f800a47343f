"""Tensor parallelism on a multi-GPU CUDA machine: k = 1 vs k = 2 (and more), side by side.

    python benchmarks/tp_gpu.py                       # random Qwen3-0.6B weights, bf16, k = 1 and 2
    python benchmarks/tp_gpu.py --tp 1 2 4 --model /path/to/Qwen3-0.6B
    python benchmarks/tp_gpu.py --smoke               # tiny config on the CPU (gloo): checks the script

Each ``k`` in ``--tp`` serves the same seeded workload (``--num-seqs`` requests, prompts of
``--min-input``..``--max-input`` random tokens, ``--min-output``..``--max-output`` generated
tokens, ``ignore_eos``) through ``LLM(tensor_parallel_size=k)``: NCCL between the GPUs, the
Triton kernels, a KV cache per rank sized by ``gpu_memory_utilization`` (the smallest any rank
can hold). Printed per ``k``: weights and KV cache per rank, the bytes all-reduced per step
(formula vs counted), how many outputs agree with ``k = 1`` (bf16 sums in another order drift,
so the first 8 tokens are counted too), tokens/s and the share of rank 0's time in collectives.

Weights: ``--model`` if given, else a local Qwen3-0.6B from the Hugging Face cache, else seeded
random weights at the Qwen3-0.6B shapes (speed does not depend on the values).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from engine_gpu import QWEN3_0_6B, SMOKE, find_local_checkpoint  # noqa: E402
from tp_cpu import make_workload, report, serve  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="Qwen3 checkpoint folder (default: local Qwen3-0.6B, else random weights)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes; the first is the baseline")
    ap.add_argument("--num-seqs", type=int, default=128)
    ap.add_argument("--min-input", type=int, default=100)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--min-output", type=int, default=100)
    ap.add_argument("--max-output", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, to check the script itself")
    args = ap.parse_args()
    if args.smoke:
        engine = dict(device="cpu", dtype=torch.float32, attention_backend="torch", num_kvcache_blocks=256,
                      max_model_len=256, max_num_batched_tokens=256)
        args.num_seqs, args.min_input, args.max_input, args.min_output, args.max_output = 6, 4, 40, 2, 12
        torch.set_num_threads(1)
        itemsize = 4
    elif not torch.cuda.is_available():
        sys.exit("tp_gpu.py needs CUDA GPUs (try --smoke to check the script on a CPU)")
    else:
        if max(args.tp) > torch.cuda.device_count():
            sys.exit(f"--tp {max(args.tp)} needs that many GPUs; this machine has {torch.cuda.device_count()}")
        engine = dict(device="cuda", dtype=torch.bfloat16, attention_backend="auto",
                      gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                      max_num_batched_tokens=args.max_num_batched_tokens)
        itemsize = 2
        print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}, torch {torch.__version__}")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else (None if args.smoke else find_local_checkpoint())
        if path is None:
            from course_pkg.models import build_random_checkpoint
            fields = SMOKE if args.smoke else QWEN3_0_6B
            path = build_random_checkpoint(Path(tmp) / "model", seed=args.seed, copy_tokenizer=False, **fields)
            print(f"random weights at {'the smoke' if args.smoke else 'the Qwen3-0.6B'} shapes")
        from course_pkg.models import load_config
        config = load_config(path)
        workload = make_workload(args.num_seqs, min(config.vocab_size, 10_000), args.seed,
                                 (args.min_input, args.max_input), (args.min_output, args.max_output))
        print(f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} heads / "
              f"{config.num_key_value_heads} KV heads; {len(workload)} requests, "
              f"{sum(len(p) for p, _ in workload)} prompt tokens")
        runs = [serve(path, k, workload, f"k={k}", max_num_seqs=args.num_seqs, **engine) for k in args.tp]
        for run in runs[1:]:
            print(f"\n{runs[0].label} vs {run.label}:")
            report(config, [runs[0], run], itemsize=itemsize)


if __name__ == "__main__":
    main()
