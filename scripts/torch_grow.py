#!/usr/bin/env python3
"""Grow one KV tensor with PyTorch, for comparison with vmarena's CUDA backing.

The same growth as `go test -bench GrowTensor` in backing/cuda: a tensor of
BYTES_PER_TOKEN bytes per token (2 KiB: one layer's K of Llama-3-8B in fp16) grows by
TOKENS tokens (1,024 = 2 MiB). Run it with PyTorch's expandable segments, which grow
one reserved range by mapping 2 MiB handles (cuMemCreate/cuMemMap/cuMemSetAccess):

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 scripts/torch_grow.py

Each case is timed REPEAT times after a warm-up, with the device synchronised before
and after, and reported as p50 and p99 in ns (and ns per token):

  alloc-new        torch.empty of one granule after empty_cache(): the allocator must
                   map fresh memory (expandable segments: create + map + access).
  alloc-cached     the same allocation again after del: the caching allocator hands the
                   block back without a driver call.
  grow-granule     the tensor grows token by token; when it is full it is reallocated
                   one granule larger and the old contents copied over (a tensor can
                   not grow in place); each token's bytes are copied in from the host
                   when --write is on (the default), as vmarena's write=true does.
  grow-cat         the naive way: torch.cat per token (a new tensor every token).
  write-prealloc   the floor: every token written into a tensor allocated up front.

--device cpu runs the same code on the CPU, only to check the script itself.
"""

import argparse
import os
import statistics
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--bytes-per-token", type=int, default=2048)
    p.add_argument("--granule", type=int, default=2 << 20, help="growth step in bytes (the CUDA granule)")
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-write", dest="write", action="store_false", help="grow without writing tokens")
    p.add_argument("--device", default="cuda")
    return p.parse_args()


def main():
    args = parse_args()
    try:
        import torch
    except ImportError as e:
        print(f"torch_grow: no torch: {e}", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("torch_grow: CUDA is not available to torch", file=sys.stderr)
        return 2

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, device {args.device}", end="")
    if dev.type == "cuda":
        print(f" ({torch.cuda.get_device_name(dev)})", end="")
    print()
    print(f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}")
    print(f"tokens {args.tokens}, bytes per token {args.bytes_per_token}, granule {args.granule}, "
          f"repeat {args.repeat}, write {args.write}")

    per_token = args.bytes_per_token // 2  # fp16 elements
    tok_host = torch.arange(per_token, dtype=torch.float16)  # pageable host memory
    tok_dev = tok_host.to(dev)
    granule_tokens = max(1, args.granule // args.bytes_per_token)

    def alloc_new():
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        sync()
        t0 = time.perf_counter_ns()
        x = torch.empty(args.granule, dtype=torch.uint8, device=dev)
        sync()
        d = time.perf_counter_ns() - t0
        del x
        return d

    def alloc_cached():
        x = torch.empty(args.granule, dtype=torch.uint8, device=dev)
        del x
        sync()
        t0 = time.perf_counter_ns()
        x = torch.empty(args.granule, dtype=torch.uint8, device=dev)
        sync()
        d = time.perf_counter_ns() - t0
        del x
        return d

    def grow_granule():
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # each growth maps fresh memory, as a new sequence would
        sync()
        t0 = time.perf_counter_ns()
        cap = 0
        t = torch.empty((0, per_token), dtype=torch.float16, device=dev)
        for i in range(args.tokens):
            if i == cap:
                cap += granule_tokens
                grown = torch.empty((cap, per_token), dtype=torch.float16, device=dev)
                grown[:i].copy_(t[:i])
                t = grown
            if args.write:
                t[i].copy_(tok_host)
        sync()
        d = time.perf_counter_ns() - t0
        del t
        return d

    def grow_cat():
        sync()
        t0 = time.perf_counter_ns()
        t = torch.empty((0, per_token), dtype=torch.float16, device=dev)
        for _ in range(args.tokens):
            t = torch.cat([t, tok_dev.view(1, per_token)])
        sync()
        d = time.perf_counter_ns() - t0
        del t
        return d

    def write_prealloc():
        t = torch.empty((args.tokens, per_token), dtype=torch.float16, device=dev)
        sync()
        t0 = time.perf_counter_ns()
        for i in range(args.tokens):
            t[i].copy_(tok_host)
        sync()
        d = time.perf_counter_ns() - t0
        del t
        return d

    cases = [
        ("alloc-new", alloc_new, 1),
        ("alloc-cached", alloc_cached, 1),
        ("grow-granule", grow_granule, args.tokens),
        ("grow-cat", grow_cat, args.tokens),
        ("write-prealloc", write_prealloc, args.tokens),
    ]
    print(f"{'case':16} {'p50-ns':>12} {'p99-ns':>12} {'p50-ns/token':>13}")
    for name, fn, tokens in cases:
        for _ in range(args.warmup):
            fn()
        d = sorted(fn() for _ in range(args.repeat))
        p50 = statistics.median(d)
        p99 = d[min(len(d) - 1, len(d) * 99 // 100)]
        per = f"{p50 / tokens:13.1f}" if tokens > 1 else f"{'':>13}"
        print(f"{name:16} {p50:12.0f} {p99:12.0f} {per}", flush=True)
    if dev.type == "cuda":
        try:
            segs = torch.cuda.memory_snapshot()
            print(f"segments {len(segs)}; expandable: {any(s.get('is_expandable') for s in segs)}")
        except Exception as e:  # the snapshot format differs between versions
            print(f"no segment snapshot: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
