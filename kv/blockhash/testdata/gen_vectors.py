#!/usr/bin/python3
"""Writes vectors.json: block-hash chains computed with Python's cbor2 and hashlib,
for blockhash's tests to check the Go chain against.

SHA256CBOR follows vLLM: sha256_cbor(x) = sha256(cbor2.dumps(x, canonical=True));
NONE_HASH = sha256_cbor(seed) with seed "vllm-none-hash" unless PYTHONHASHSEED is
set; block i = sha256_cbor((parent, tuple(tokens), extra_keys or None)), the parent
of block 0 being NONE_HASH; the published 64-bit hash is
int.from_bytes(digest, "big") & (2**64 - 1). Extra keys: the LoRA name on every
block, then the cache salt on block 0 only.

FNV64CBOR: root = FNV-1a 64 of the seed's UTF-8 bytes; block i = FNV-1a 64 of
cbor2.dumps([parent, tokens, extra_keys or None], canonical=True), the parent an
unsigned integer.

Run with Debian's interpreter, which sees python3-cbor2:
    /usr/bin/python3 gen_vectors.py > vectors.json
"""

import hashlib
import json
import random

import cbor2

MASK = (1 << 64) - 1


def sha256_cbor(x):
    return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()


def fnv1a(b):
    h = 14695981039346656037
    for c in b:
        h ^= c
        h = (h * 1099511628211) & MASK
    return h


def extra_keys(i, lora, salt):
    keys = []
    if lora:
        keys.append(lora)
    if i == 0 and salt:
        keys.append(salt)
    return tuple(keys) if keys else None


def chain(algorithm, block_size, seed, lora, salt, tokens):
    if algorithm == "sha256_cbor":
        parent = sha256_cbor(seed or "vllm-none-hash")
        root = parent.hex()
    else:
        parent = fnv1a(seed.encode())
        root = "%016x" % parent
    hashes, published, payloads = [], [], []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        extra = extra_keys(i, lora, salt)
        if algorithm == "sha256_cbor":
            item = (parent, tuple(block), extra)
            payloads.append(cbor2.dumps(item, canonical=True).hex())
            parent = sha256_cbor(item)
            hashes.append(parent.hex())
            published.append(int.from_bytes(parent, "big") & MASK)
        else:
            item = [parent, list(block), list(extra) if extra else None]
            payloads.append(cbor2.dumps(item, canonical=True).hex())
            parent = fnv1a(cbor2.dumps(item, canonical=True))
            hashes.append("%016x" % parent)
            published.append(parent)
    return root, hashes, published, payloads


def main():
    r = random.Random(27)
    edges = [0, 1, 23, 24, 255, 256, 65535, 65536, 151643, 2**31 - 1]
    cases = []
    for algorithm in ("sha256_cbor", "fnv64_cbor"):
        for block_size, seed, lora, salt, n in [
            (16, "", "", "", 40),
            (16, "0", "", "", 64),
            (4, "", "adapter-a", "", 13),
            (4, "seed", "", "tenant-7", 12),
            (1, "", "x", "salt", 5),
            (16, "", "", "", 15),
            (8, "vllm-none-hash", "", "", 32),
        ]:
            tokens = [r.choice(edges) if r.random() < 0.3 else r.randrange(0, 200000)
                      for _ in range(n)]
            root, hashes, published, payloads = chain(
                algorithm, block_size, seed, lora, salt, tokens)
            cases.append({
                "algorithm": algorithm, "block_size": block_size, "seed": seed,
                "lora": lora, "cache_salt": salt, "tokens": tokens, "root": root,
                "hashes": hashes, "published": published, "payloads": payloads,
            })
    print(json.dumps({"generator": "gen_vectors.py (cbor2 canonical, hashlib)",
                      "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
