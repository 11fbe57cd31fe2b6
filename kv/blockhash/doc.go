// Package blockhash chains 64-bit hashes over fixed-size blocks of token IDs: the keys
// by which a prefix cache announces what it holds (KV events) and by which a router or
// a cache tier names a block.
//
// A sequence of tokens is cut into blocks of BlockSize tokens (16 by default, as in
// vLLM); a last block that is not full has no hash. Block i's hash covers its tokens,
// the hash of block i-1 (for block 0, the root: a hash of the seed) and the block's
// extra keys (a LoRA name on every block, a cache salt on block 0), so that equal
// hashes name equal prefixes, not merely equal blocks.
//
// Two algorithms:
//
//   - FNV64CBOR (the default): FNV-1a 64 over the canonical CBOR encoding of the array
//     [parent, tokens, extra], the parent as an unsigned integer; the root is FNV-1a 64
//     of the seed's bytes. This is the chain llm-d's indexer computes over token IDs
//     (llm-d/llm-d-kv-cache, pkg/kvcache/kvblock/token_processor.go), without its
//     per-model root step.
//   - SHA256CBOR: vLLM's sha256_cbor, bit for bit. Block i's digest is SHA-256 over
//     canonical CBOR of (parent digest as a byte string, tokens, extra keys or null);
//     the root (vLLM's NONE_HASH) is sha256_cbor of the seed string, "vllm-none-hash"
//     unless a seed (vLLM's PYTHONHASHSEED) is given. The 64-bit hash vLLM publishes in
//     its KV events is the digest's last 8 bytes read big-endian (int.from_bytes(digest,
//     "big") & (2**64-1)); the chain itself runs on the full 32 bytes. See
//     vllm/utils/hashing.py (sha256_cbor), vllm/v1/core/kv_cache_utils.py
//     (hash_block_tokens, init_none_hash, maybe_convert_block_hash,
//     generate_block_hash_extra_keys) and vllm/envs.py
//     (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, on by default). testdata holds vectors made
//     by Python's cbor2 and hashlib, and the script that made them.
//
// # Concurrency
//
// A Hasher is immutable once made: any number of goroutines may use it at once.
package blockhash
