#!/usr/bin/python3
"""Writes namespace_events.json: what a prefix cache's KV events must announce for
prompts inserted in kv.Namespaces, computed from vLLM's definition with Python's
cbor2 and hashlib, for namespace_events_test.go to check the cache's events against.

vLLM (vllm/v1/core/kv_cache_utils.py, vllm/utils/hashing.py):
  sha256_cbor(x) = sha256(cbor2.dumps(x, canonical=True))
  NONE_HASH = sha256_cbor("vllm-none-hash") when PYTHONHASHSEED is not set
  block i = sha256_cbor((parent, tuple(tokens of block i), extra_keys))
  extra_keys (generate_block_hash_extra_keys) = the LoRA name (lora_name) on every
  block, then the cache salt on the block that starts at token 0 only; a tuple, or
  None when empty
  the 64-bit hash a KV event publishes = int.from_bytes(digest, "big") & (2**64 - 1)
BlocksStored's lora_name is the adapter's name, None for none.

A namespace's adapter is its Adapter, else EventOptions.Hash.LoRA; its salt its Salt,
else EventOptions.Hash.CacheSalt (kv.Namespace).

Run with Debian's interpreter, which sees python3-cbor2:
    /usr/bin/python3 gen_namespace_events.py > namespace_events.json
"""

import hashlib
import json

import cbor2

MASK = (1 << 64) - 1


def sha256_cbor(x):
    return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()


def chain(block_size, lora, salt, tokens):
    parent = sha256_cbor("vllm-none-hash")
    hashes, extras = [], []
    for i in range(len(tokens) // block_size):
        keys = []
        if lora:
            keys.append(lora)
        if i == 0 and salt:
            keys.append(salt)
        extra = tuple(keys) if keys else None
        parent = sha256_cbor((parent, tuple(tokens[i * block_size:(i + 1) * block_size]), extra))
        hashes.append(int.from_bytes(parent, "big") & MASK)
        extras.append(list(extra) if extra else None)
    return hashes, extras


def main():
    tokens = [151643, 9707, 11, 1879, 0, 1, 65535, 65536, 2**31 - 1, 42, 7, 7, 7,
              100000, 23, 24, 255, 256, 3, 4, 5]
    cases = []
    for base_lora, base_salt in (("", ""), ("base-lora", "base-salt")):
        for adapter, salt in (("", ""), ("adapter-a", ""), ("", "tenant-7"),
                              ("adapter-a", "tenant-7"), ("adapter-b", "")):
            lora = adapter or base_lora
            s = salt or base_salt
            hashes, extras = chain(4, lora, s, tokens)
            cases.append({
                "base_lora": base_lora, "base_salt": base_salt,
                "adapter": adapter, "salt": salt, "block_size": 4,
                "tokens": tokens, "split": 13, "lora_name": lora,
                "hashes": hashes, "extra_keys": extras,
            })
    print(json.dumps({"generator": "gen_namespace_events.py (cbor2 canonical, hashlib)",
                      "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
