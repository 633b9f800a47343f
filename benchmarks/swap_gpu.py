"""Swap against recompute on a GPU: host-device copy bandwidth next to the prefill it replaces (ch. 09).

    python benchmarks/swap_gpu.py                 # on a CUDA machine: bf16, lengths 64-8192
    python benchmarks/swap_gpu.py --smoke         # anywhere (CPU here): tiny sizes, end to end

A preempted sequence's K/V can be recomputed (one prefill forward over its tokens) or swapped:
copied to pinned host memory (``ModelRunner.swap_out``) and back (``ModelRunner.swap_in``). The
copy moves ``2 x layers x tokens x kv_heads x head_dim`` values each way over the host-device
link; the prefill costs ``2 x parameters x tokens`` FLOPs plus attention. Per length this
prints both times, the copy bandwidth in GB/s (pinned, so at the link's speed), and the
crossover -- the shortest length from which recompute is the cheaper of the two. The model is
a seeded random Qwen3 (``build_random_checkpoint``), by default the course's benchmark shape and
a larger one (``--large``), built offline.

On a CPU the "device" cache is host memory, so ``--smoke`` only proves the script runs; its
figures say nothing about a GPU.
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

from course_pkg.workloads.swap_cost import measure_swap_vs_recompute  # noqa: E402
from course_pkg.models import build_random_checkpoint  # noqa: E402
from scheduling import print_swap_rows  # noqa: E402

LARGE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, max_position_embeddings=8192)   # ~Qwen3-0.6B's shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; runs on a CPU")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        sys.exit("no CUDA device: run with --smoke to check the script on a CPU")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if cuda:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, bfloat16")
    else:
        print(f"torch {torch.__version__}, CPU smoke run (float32, tiny sizes: not a GPU measurement)")
    lengths = [64, 128, 256] if args.smoke else [64 * 2**i for i in range(8)]   # .. 8192
    with tempfile.TemporaryDirectory() as tmp:
        models = [("benchmark model", dict(max_position_embeddings=8192))]
        models += [] if args.smoke else [("large model", LARGE)]
        for label, overrides in models:
            if args.smoke:
                overrides = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1)
            path = build_random_checkpoint(Path(tmp) / label.replace(" ", "-"), seed=args.seed,
                                           copy_tokenizer=False, **overrides)
            config, rows = measure_swap_vs_recompute(path, lengths, device=device, dtype=dtype, repeats=args.repeats)
            print_swap_rows(label, config, rows)


if __name__ == "__main__":
    main()
