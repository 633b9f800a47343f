"""The disk tier (chapter 15): one file per block in a directory that outlives the engine.

A second process on the same directory and model serves the first one's prefixes from disk --
prefill saved, tokens unchanged (Hugging Face's). A directory written for another model, block
size or dtype, or not a tier directory at all, is refused by name and never read; a truncated or
corrupt block file, or one whose digest names another prefix, is a miss, never used.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from course_pkg import LLM, SamplingParams
from course_pkg.models import default_model_path
from course_pkg.offload.disk import DiskTier, prefix_digests
from tests.helpers import check_tier
from tests.test_engine import hf_greedy, make_prompts

MODEL = default_model_path()
CPU = dict(device="cpu", dtype=torch.float32, attention_backend="torch")
ROOT = Path(__file__).resolve().parents[1]


def tier(path, num_cpu_blocks=16, num_disk_blocks=400) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"num_cpu_blocks": num_cpu_blocks, "disk_path": str(path),
                                          "num_disk_blocks": num_disk_blocks}}


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """One torch thread for this module (see conftest)."""


@pytest.fixture(scope="module")
def prompts(hf_model):
    return [p for p in make_prompts(hf_model.config.vocab_size) if len(p) >= 9]


@pytest.fixture(scope="module")
def expected(hf_model, prompts):
    return [hf_greedy(hf_model, p, 3) for p in prompts]


def first_process(path, prompts) -> dict:
    """Another Python process serves ``prompts`` with a disk tier at ``path`` and exits; returns
    its metrics."""
    code = textwrap.dedent(f"""
        import json, sys, torch
        torch.set_num_threads(1)
        from course_pkg import LLM, SamplingParams
        llm = LLM(device="cpu", dtype=torch.float32, attention_backend="torch", block_size=4, num_kvcache_blocks=40,
                  max_num_seqs=4, kv_transfer_config={json.dumps(tier(path))})
        llm.generate(json.loads(sys.stdin.read()), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
        print(json.dumps(llm.get_metrics().as_dict()))
    """)
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(prompts), capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def second(path, **kw):
    return LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=40, max_num_seqs=4, kv_transfer_config=tier(path), **kw)


def generate(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0,
                                                                                ignore_eos=True), use_tqdm=False)]


def test_a_second_process_serves_the_first_ones_prefixes_from_disk(tmp_path, prompts, expected):
    path = tmp_path / "tier"
    first = first_process(path, prompts)
    files = list(path.glob("*.kv"))
    assert first["kv_offload_disk_blocks_stored"] == len(files) > 0
    llm = second(path)
    assert len(llm.scheduler.offload.disk_names) == len(files)   # found at start, before any request
    assert generate(llm, prompts) == expected
    m = llm.get_metrics()
    assert m.external_prefix_cache_hits > 0 and m.kv_offload_disk_blocks_loaded > 0
    # the prompts' full blocks but the last of each, less what the device pool found itself
    candidates = sum((len(p) - 1) // 4 * 4 for p in prompts)
    assert m.prefix_cache_hits + m.external_prefix_cache_hits == candidates
    assert m.prefill_kv_computed_tokens < first["prefill_kv_computed_tokens"] / 5   # (the prefill saved)
    check_tier(llm.scheduler.offload)


def test_a_corrupt_truncated_or_misnamed_block_file_is_a_miss_never_used(tmp_path, prompts, expected):
    path = tmp_path / "tier"
    first_process(path, prompts)
    clean = second(path)
    generate(clean, prompts)
    clean_hits = clean.get_metrics().external_prefix_cache_hits
    files = sorted(path.glob("*.kv"))
    flipped, cut, moved = files[0], files[1], files[2]
    data = bytearray(flipped.read_bytes())
    data[-5] ^= 0xFF                      # one bit pattern in the payload: the checksum catches it
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-100])   # truncated: the scan drops it
    other = files[3]
    shutil.copy(other, moved)             # another block's file under this block's hash: the digest differs
    llm = second(path)
    assert not cut.exists() and len(llm.scheduler.offload.disk_names) == len(files) - 1
    assert generate(llm, prompts) == expected
    m = llm.get_metrics()
    assert 0 < m.external_prefix_cache_hits < clean_hits
    assert not flipped.exists() or flipped.read_bytes() != bytes(data)   # forgotten (and rewritten, if stored again)
    check_tier(llm.scheduler.offload)


def test_a_directory_for_another_model_block_size_or_dtype_is_refused_unread(tmp_path, prompts):
    path = tmp_path / "tier"
    first_process(path, prompts[:2])
    before = {f.name: f.read_bytes() for f in path.iterdir()}
    with pytest.raises(ValueError, match="another block_size: block_size 4 there, 8 here"):
        LLM(MODEL, **CPU, block_size=8, num_kvcache_blocks=20, kv_transfer_config=tier(path))
    with pytest.raises(ValueError, match="another dtype"):
        LLM(MODEL, device="cpu", dtype=torch.bfloat16, attention_backend="torch", block_size=4, num_kvcache_blocks=20,
            kv_transfer_config=tier(path))
    other_model = tmp_path / "model"
    shutil.copytree(MODEL, other_model)
    weights = next(other_model.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1                           # the same shapes, other weights: another model
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="another model"):
        LLM(other_model, **CPU, block_size=4, num_kvcache_blocks=20, kv_transfer_config=tier(path))
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before   # nothing read, written or removed
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("not a tier")
    with pytest.raises(ValueError, match="not a tier directory"):
        LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=20, kv_transfer_config=tier(stranger))
    manifest = json.loads((path / "tier.json").read_text())
    (path / "tier.json").write_text(json.dumps({**manifest, "format": "course-kv-tier/0"}))
    with pytest.raises(ValueError, match="another format"):
        LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=20, kv_transfer_config=tier(path))


def test_prefix_digests_name_the_whole_prefix_and_the_salt():
    a = prefix_digests(list(range(12)), 4, 3)
    assert len(a) == 3 and len(set(a)) == 3 and all(len(d) == 32 for d in a)
    assert prefix_digests(list(range(12)), 4, 2) == a[:2]
    assert prefix_digests([99] + list(range(1, 12)), 4, 3)[2] != a[2]   # a change at position 0 reaches block 2
    assert prefix_digests(list(range(12)), 4, 3, "alice")[0] != a[0]
    assert prefix_digests(list(range(12)), 4, 3, "alice") != prefix_digests(list(range(12)), 4, 3, "bob")
    assert prefix_digests(list(range(12)), 4, 3, start=1, previous=a[0]) == a[1:]   # going on from a block
    with pytest.raises(ValueError, match="previous"):
        prefix_digests(list(range(12)), 4, 3, start=1)


def test_a_disk_block_file_round_trips_and_a_wrong_digest_reads_nothing(tmp_path):
    d = DiskTier(tmp_path / "t", {"model": "m", "block_size": 4}, payload_bytes=16)
    digest = prefix_digests([1, 2, 3, 4], 4, 1)[0]
    d.write(7, digest, bytes(range(16)))
    assert d.read(7, digest) == bytes(range(16))
    assert d.read(7, b"\0" * 32) is None and d.read(8, digest) is None
    assert d.scan() == [(7, digest)]
    with pytest.raises(ValueError, match="holds 16 bytes"):
        d.write(9, digest, b"short")
