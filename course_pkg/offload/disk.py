"""The disk tier's files: one file per block in a directory that outlives the engine (chapter 15).

Why one file per block, not one memory-mapped pool: a block is written once, whole, and read
whole, so a file is the natural unit -- written to a temporary name and renamed, a crash leaves a
block complete or absent, never half-overwritten; an evicted block is one ``unlink``; a corrupt
block costs that block only; and a second engine finds the blocks by listing the directory, with
no index to keep consistent. (A pool file would need its own slot table, written in step with the
slots, to survive a restart.) The price is a file-system call per block, which only matters for
blocks far smaller than a real model's (megabytes each).

A directory belongs to one model, block size, dtype and format, written in ``tier.json`` when the
directory is made; ``DiskTier`` refuses a directory written for anything else, with the fields that
differ, and never reads its blocks. A block file is ``<hash>.kv``: a header -- magic, version, the
SHA-256 *digest* of the block's whole prefix (its salt and every token from position 0: a name
that means the same in every process, unlike the device pool's prefix ids), the payload's length
and its xxhash64 -- then the K/V bytes. ``read`` checks all of it and returns None for a block that
is missing, truncated, corrupt or another prefix's: a miss, never wrong bytes.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import xxhash

FORMAT = "course-kv-tier/1"
MAGIC = b"CKVT"
_HEADER = struct.Struct("<4sI32sQQ")   # magic, version, prefix digest, payload bytes, payload xxhash64
VERSION = 1


def prefix_digests(token_ids, block_size: int, num_blocks: int, cache_salt: str | None = None, *,
                   start: int = 0, previous: bytes | None = None) -> list[bytes]:
    """SHA-256 of each of the first ``num_blocks`` full blocks' whole prefix, chained: the salt,
    then each block's tokens (8 bytes each, little-endian) on the digest before it. With ``start``
    and ``previous`` (block ``start - 1``'s digest), only blocks ``start .. num_blocks - 1``."""
    if previous is None:
        if start:
            raise ValueError("prefix_digests from a later block needs the digest before it (previous)")
        previous = hashlib.sha256(b"salt:" + cache_salt.encode() if cache_salt is not None else b"no salt").digest()
    digest = previous
    packer = struct.Struct(f"<{block_size}q")
    digests = []
    for i in range(start, num_blocks):
        digest = hashlib.sha256(digest + packer.pack(*token_ids[i * block_size:(i + 1) * block_size])).digest()
        digests.append(digest)
    return digests


def model_identity(path) -> str:
    """A fingerprint of a checkpoint: SHA-256 of its ``config.json`` and every ``*.safetensors``
    file, bytes and names. (A fine-tuned copy with the same shapes is another model; the price is
    reading the weights once per engine start -- fast for the course's model, some seconds per
    gigabyte for a real one. LMCache keys its disk cache by the model's name instead.)"""
    path = Path(path)
    h = hashlib.sha256()
    for f in [path / "config.json"] + sorted(path.glob("*.safetensors")):
        h.update(f.name.encode())
        with open(f, "rb") as stream:
            for chunk in iter(lambda: stream.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


class DiskTier:
    """One directory of block files (see the module docstring). ``layout`` describes what the
    blocks hold -- model identity, block size, dtype, layers, KV heads, head dim -- and must equal
    the directory's ``tier.json`` if it has one."""

    def __init__(self, path, layout: dict, payload_bytes: int):
        self.path = Path(path)
        self.payload_bytes = payload_bytes
        manifest = {"format": FORMAT, **layout}
        file = self.path / "tier.json"
        if file.exists():
            try:
                found = json.loads(file.read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"disk tier {str(self.path)!r}: tier.json is unreadable ({e}); not a tier directory "
                                 "this engine can use") from None
            differ = sorted(k for k in manifest.keys() | found.keys() if manifest.get(k) != found.get(k))
            if differ:
                raise ValueError(f"disk tier {str(self.path)!r} was written for another "
                                 f"{', '.join(differ)}: " + "; ".join(f"{k} {found.get(k)!r} there, {manifest.get(k)!r} here"
                                                                      for k in differ)
                                 + ". Its blocks would be wrong here: use another directory")
        else:
            if self.path.exists() and any(self.path.iterdir()):
                raise ValueError(f"disk tier {str(self.path)!r} is not empty and has no tier.json: not a tier "
                                 "directory; give an empty or new directory")
            self.path.mkdir(parents=True, exist_ok=True)
            tmp = file.with_suffix(".tmp")
            tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
            os.replace(tmp, file)

    def file(self, block_hash: int) -> Path:
        return self.path / f"{block_hash:016x}.kv"

    def scan(self) -> list[tuple[int, bytes]]:
        """The blocks the directory holds, oldest first: ``(hash, prefix digest)`` of each file whose
        name, header and length are right (the payload's checksum is checked when it is read).
        A file that is not is removed: it could never be used."""
        found = []
        for f in sorted(self.path.glob("*.kv"), key=lambda f: (f.stat().st_mtime_ns, f.name)):
            try:
                block_hash = int(f.stem, 16)
                with open(f, "rb") as stream:
                    magic, version, digest, length, _ = _HEADER.unpack(stream.read(_HEADER.size))
                ok = (magic, version, length) == (MAGIC, VERSION, self.payload_bytes) and \
                    f.stat().st_size == _HEADER.size + length
            except (ValueError, OSError, struct.error):
                ok = False
            if ok:
                found.append((block_hash, digest))
            else:
                f.unlink(missing_ok=True)
        return found

    def write(self, block_hash: int, digest: bytes, payload: bytes) -> None:
        """Write a block: to a temporary name, then renamed, so the file is whole or absent."""
        if len(payload) != self.payload_bytes:
            raise ValueError(f"a block holds {self.payload_bytes} bytes here, got {len(payload)}")
        header = _HEADER.pack(MAGIC, VERSION, digest, len(payload), xxhash.xxh64_intdigest(payload))
        file = self.file(block_hash)
        tmp = file.with_suffix(".tmp")
        with open(tmp, "wb") as stream:
            stream.write(header)
            stream.write(payload)
        os.replace(tmp, file)

    def read(self, block_hash: int, digest: bytes) -> bytes | None:
        """The block's K/V bytes if its file is whole, uncorrupted and names the prefix ``digest``;
        else None."""
        try:
            data = self.file(block_hash).read_bytes()
            magic, version, found, length, checksum = _HEADER.unpack_from(data)
        except (OSError, struct.error):
            return None
        payload = data[_HEADER.size:]
        if (magic, version, found, length) != (MAGIC, VERSION, digest, self.payload_bytes) or len(payload) != length \
                or xxhash.xxh64_intdigest(payload) != checksum:
            return None
        return payload

    def delete(self, block_hash: int) -> None:
        self.file(block_hash).unlink(missing_ok=True)
