#!/usr/bin/env python3
"""Price kv's layouts on a GPU: one decode step's attention read, per layer.

The host benchmarks (kv: BenchmarkReadLayer, BenchmarkDecodeStep) price the layouts on
a CPU; this script prices them where decoding really runs. Every layout holds the same
K and V of a batch of sequences of Llama-3-8B (32 layers, 8 KV heads of 128, fp16:
2 KiB per token, layer and kind) in one buffer, placed as kv places it:

  per-layer     [seq][layer][K|V][token][head][dim]: one contiguous run per tensor
  per-sequence  [seq][token][layer][K|V][head][dim]: 2 KiB runs, 128 KiB apart
  blocked-T     [seq][block][layer][K|V][T tokens][head][dim]: T=16 is kv.Blocked's
                default (2 MiB blocks, 32 KiB runs), T=64 and 128 are Config.BlockTokens
  paged         vLLM's pools: [layer][K|V][block][16 tokens][head][dim], each
                sequence's blocks taken at random through a block table

Memory comes from PyTorch with expandable segments (set before torch is imported), so
it is mapped in 2 MiB cuMemCreate handles, as the CUDA backing maps it.

Two reads, each over every layer in a scattered order, captured in a CUDA graph (so
that Python's launches do not set the time of a small batch) and timed with CUDA
events (the median of --repeat passes, per layer):

  attention  a decode attention kernel (Triton, flash-decoding: each sequence's tokens
             split in --splits parts, --bn tokens read a step) reading every K and V
             of the layer through a table of 16-token chunks, the way a paged kernel
             reads; the same kernel for every layout, only its table and token stride
             differ. Its output is checked against PyTorch's attention on the
             contiguous tensors; a mismatch fails the layout.
  copy       PyTorch gathering one layer's K into a contiguous tensor (a strided copy,
             or index_select through the block table for paged); the floor is one
             contiguous copy of the same bytes. Not timed for strided views of a
             buffer of 2^31 elements or more, where PyTorch's strided copy is slow
             for every layout alike.

--batch sets the number of sequences (8 is the host benchmarks' batch; 64 fills the
GPU), --tokens their length.
"""

import argparse
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

LAYERS, KVH, D, G = 32, 8, 128, 4  # Llama-3-8B: 32 query heads in groups of 4
E = KVH * D  # elements per token, layer and kind
CH = 16  # tokens per chunk of the kernel's table
BN = 64  # tokens the kernel reads per step (--bn)


def layout_offsets(name, B, N, perm):
    """Element offsets [LAYERS][2][B][N/CH] of each 16-token chunk, the token stride,
    and the buffer's size in elements."""
    nc = N // CH
    s = torch.arange(B).view(B, 1)
    c = torch.arange(nc).view(1, nc)
    offs = torch.empty(LAYERS, 2, B, nc, dtype=torch.int64)
    total = B * N * LAYERS * 2 * E
    for l in range(LAYERS):
        for k in range(2):
            lk = l * 2 + k
            if name == "per-layer":
                o = (s * LAYERS * 2 + lk) * N * E + c * CH * E
                ts = E
            elif name == "per-sequence":
                o = s * N * LAYERS * 2 * E + c * CH * LAYERS * 2 * E + lk * E
                ts = LAYERS * 2 * E
            elif name.startswith("blocked-"):
                T = int(name.split("-")[1])
                blk, within = (c * CH) // T, (c * CH) % T
                o = s * N * LAYERS * 2 * E + blk * LAYERS * 2 * T * E + lk * T * E + within * E
                ts = E
            elif name == "paged":
                nb = B * nc
                o = (lk * nb + perm.view(B, nc)) * CH * E
                ts = E
            else:
                raise ValueError(name)
            offs[l, k] = o
    return offs, ts, total


def fill(buf, offs, ts, K, V):
    """Writes the logical K and V [LAYERS][B][N][E] into buf at offs."""
    B, nc = offs.shape[2], offs.shape[3]
    t = torch.arange(CH, device=buf.device).view(1, 1, CH, 1) * ts
    e = torch.arange(E, device=buf.device).view(1, 1, 1, E)
    for l in range(LAYERS):
        for k, X in ((0, K), (1, V)):
            idx = offs[l, k].to(buf.device).view(B, nc, 1, 1) + t + e
            buf[idx.view(-1)] = X[l].reshape(-1)


def make_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def decode_attn(buf, kofs, vofs, q, out_acc, out_m, out_l, ts, nc, cps, scale,
                    KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, CH: tl.constexpr,
                    BN: tl.constexpr, SPLITS: tl.constexpr):
        # One program: one sequence, one KV head, one split of the tokens. The G query
        # heads of the group sit in the first G of 16 rows (tl.dot's smallest M); BN
        # tokens (BN/CH chunks of the table) are read per step, as paged kernels do.
        s = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        offs_m = tl.arange(0, 16)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BN)
        qv = tl.load(q + ((s * KVH + h) * 16 + offs_m[:, None]) * D + offs_d[None, :])
        m = tl.full([16], float("-inf"), tl.float32)
        lsum = tl.zeros([16], tl.float32)
        acc = tl.zeros([16, D], tl.float32)
        tok = (offs_n % CH) * ts + h * D
        c0 = sp * cps
        for c in range(c0, c0 + cps, BN // CH):
            kb = tl.load(kofs + s * nc + c + offs_n // CH)
            vb = tl.load(vofs + s * nc + c + offs_n // CH)
            kt = tl.load(buf + (kb + tok)[:, None] + offs_d[None, :])
            sc = tl.dot(qv, tl.trans(kt)) * scale
            mn = tl.maximum(m, tl.max(sc, axis=1))
            alpha = tl.exp(m - mn)
            p = tl.exp(sc - mn[:, None])
            lsum = lsum * alpha + tl.sum(p, axis=1)
            vt = tl.load(buf + (vb + tok)[:, None] + offs_d[None, :])
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), vt)
            m = mn
        o = (s * KVH + h) * SPLITS + sp
        rows = offs_m < G
        tl.store(out_acc + (o * G + offs_m[:, None]) * D + offs_d[None, :], acc, mask=rows[:, None])
        tl.store(out_m + o * G + offs_m, m, mask=rows)
        tl.store(out_l + o * G + offs_m, lsum, mask=rows)

    return decode_attn


def graphed(fn):
    """fn captured in a CUDA graph, so that a pass's 32 launches cost the GPU's time
    and not Python's: at 8 sequences a layer's kernel takes about as long as
    launching it. Falls back to fn where capture fails."""
    try:
        fn()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
        return g.replay
    except Exception as e:
        print(f"graph capture failed, launching from Python: {e}")
        return fn


def time_passes(fn, repeat):
    """Median ms of fn() over repeat runs, after two warm-ups; fn is captured in a CUDA
    graph first."""
    fn = graphed(fn)
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--splits", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--bn", type=int, default=BN, help="tokens the kernel reads per step")
    ap.add_argument("--warps", type=int, default=4, help="the kernel's num_warps")
    ap.add_argument("--layouts", nargs="+",
                    default=["per-layer", "blocked-16", "blocked-64", "blocked-128", "paged",
                             "per-sequence"])
    args = ap.parse_args()
    bn = args.bn
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
          f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')}; "
          f"kernel: {bn} tokens a step, {args.splits} splits, {args.warps} warps")
    try:
        kern = make_kernel()
    except Exception:
        traceback.print_exc()
        kern = None
    order = [(l * 13) % LAYERS for l in range(LAYERS)]  # scattered, every layer once
    N = args.tokens
    failed = kern is None
    assert N % 128 == 0 and (N // CH) % (args.splits * (bn // CH)) == 0
    for B in args.batch:
        print(f"\n## batch {B} x {N} tokens: {B * N * 2 * E * 2 / 2**20:.0f} MiB per layer (K+V), "
              f"{B * N * LAYERS * 2 * E * 2 / 2**30:.1f} GiB in all; medians of {args.repeat} passes")
        g = torch.Generator().manual_seed(1)
        nc = N // CH
        perm = torch.randperm(B * nc, generator=g)
        K = torch.randn(LAYERS, B, N, E, device=dev, dtype=torch.float16)
        V = torch.randn(LAYERS, B, N, E, device=dev, dtype=torch.float16)
        q = torch.randn(B, KVH, G, D, device=dev, dtype=torch.float16).float()
        q16 = torch.zeros(B, KVH, 16, D, device=dev, dtype=torch.float16)
        q16[:, :, :G] = q.half()
        scale = D ** -0.5
        SP = args.splits
        acc = torch.empty(B, KVH, SP, G, D, device=dev)
        mm = torch.empty(B, KVH, SP, G, device=dev)
        ll = torch.empty(B, KVH, SP, G, device=dev)
        kdst = torch.empty(B, N, E, device=dev, dtype=torch.float16)
        floor_src = torch.randn(B * N * E, device=dev, dtype=torch.float16)
        # A fresh GPU runs slower for its first moments: copy for a second before timing.
        t_end = time.monotonic() + 1
        while time.monotonic() < t_end:
            kdst.view(-1).copy_(floor_src)
            torch.cuda.synchronize()
        floor = time_passes(lambda: [kdst.view(-1).copy_(floor_src) for _ in order], args.repeat) / LAYERS
        rows = []
        for name in args.layouts:
            try:
                offs, ts, total = layout_offsets(name, B, N, perm)
                buf = torch.empty(total, device=dev, dtype=torch.float16)
                fill(buf, offs, ts, K, V)
                goffs = offs.to(dev)
                row = {"layout": name, "align": buf.data_ptr() % (2 << 20)}
                if kern is not None:
                    def attn(l):
                        kern[(B, KVH, SP)](buf, goffs[l, 0], goffs[l, 1], q16, acc, mm, ll,
                                           ts, nc, nc // SP, scale,
                                           KVH=KVH, G=G, D=D, CH=CH, BN=bn, SPLITS=SP,
                                           num_warps=args.warps)
                    # check layer 5 against PyTorch on the contiguous tensors
                    attn(5)
                    M = mm.max(dim=2, keepdim=True).values
                    w = torch.exp(mm - M)
                    out = (acc * w[..., None]).sum(2) / (ll * w).sum(2)[..., None]
                    k5 = K[5].view(B, N, KVH, D).float()
                    v5 = V[5].view(B, N, KVH, D).float()
                    sc = torch.einsum("bhgd,bnhd->bhgn", q, k5) * scale
                    ref = torch.einsum("bhgn,bnhd->bhgd", sc.softmax(-1), v5)
                    row["err"] = (out - ref).abs().max().item()
                    if not row["err"] < 1e-2:
                        raise AssertionError(f"attention differs from PyTorch's by {row['err']}")
                    row["attn"] = time_passes(lambda: [attn(l) for l in order], args.repeat) / LAYERS
                # copy: one layer's K, gathered contiguous
                if name == "paged":
                    pool = buf.view(LAYERS, 2, B * nc, CH * E)
                    tab = perm.to(dev)

                    def cp(l):
                        torch.index_select(pool[l, 0], 0, tab, out=kdst.view(B * nc, CH * E))
                else:
                    strided = strided_views(name, buf, B, N)

                    def cp(l):
                        kdst.view(strided[l].shape).copy_(strided[l])
                if total < 2**31 or name == "paged":
                    row["copy"] = time_passes(lambda: [cp(l) for l in order], args.repeat) / LAYERS
                rows.append(row)
                buf = goffs = None  # free the layout before the next
                torch.cuda.empty_cache()
            except Exception:
                print(f"{name}: failed")
                traceback.print_exc()
                failed = True
        report(rows, floor, B, N)
        K = V = floor_src = kdst = None  # free the batch before the next
        torch.cuda.empty_cache()
    return 1 if failed else 0


def strided_views(name, buf, B, N):
    """One layer's K of every sequence as a strided view of buf, per layer."""
    views = []
    for l in range(LAYERS):
        lk = l * 2
        if name == "per-layer":
            v = torch.as_strided(buf, (B, N, E), (LAYERS * 2 * N * E, E, 1), lk * N * E)
        elif name == "per-sequence":
            v = torch.as_strided(buf, (B, N, E), (N * LAYERS * 2 * E, LAYERS * 2 * E, 1), lk * E)
        elif name.startswith("blocked-"):
            T = int(name.split("-")[1])
            v = torch.as_strided(buf, (B, N // T, T, E),
                                 (N * LAYERS * 2 * E, LAYERS * 2 * T * E, E, 1), lk * T * E)
        else:
            raise ValueError(name)
        views.append(v)
    return views


def report(rows, floor, B, N):
    base = {r["layout"]: r for r in rows}
    pl = base.get("per-layer")
    pg = base.get("paged")
    kv_bytes = B * N * 2 * E * 2
    k_bytes = B * N * E * 2
    print(f"floor: one contiguous copy of a layer's K ({k_bytes / 2**20:.0f} MiB): "
          f"{floor * 1e3:.1f} us, {k_bytes / floor / 1e6:.0f} GB/s read")
    if "copy" not in (pl or {}):
        print("copy: not timed for strided views of a buffer of 2^31 elements or more "
              "(PyTorch's strided copy took 2.6x the floor there for every layout, "
              "per-layer's 2 MiB runs too; index_select did not)")
    print(f"{'layout':<14} {'attn us':>9} {'x per-layer':>12} {'x paged':>8} {'GB/s':>6} "
          f"{'copy us':>9} {'x per-layer':>12} {'x floor':>8} {'max err':>8} {'2MiB off':>9}")
    for r in rows:
        a = r.get("attn")
        cells = [f"{r['layout']:<14}"]
        if a is not None:
            cells += [f"{a * 1e3:9.1f}",
                      f"{a / pl['attn']:11.2f}x" if pl and "attn" in pl else f"{'-':>12}",
                      f"{a / pg['attn']:7.2f}x" if pg and "attn" in pg else f"{'-':>8}",
                      f"{kv_bytes / a / 1e6:6.0f}"]
        else:
            cells += [f"{'-':>9}", f"{'-':>12}", f"{'-':>8}", f"{'-':>6}"]
        c = r.get("copy")
        if c is not None:
            cells += [f"{c * 1e3:9.1f}",
                      f"{c / pl['copy']:11.2f}x" if pl and "copy" in pl else f"{'-':>12}",
                      f"{c / floor:7.2f}x"]
        else:
            cells += [f"{'-':>9}", f"{'-':>12}", f"{'-':>8}"]
        cells += [f"{r.get('err', float('nan')):8.1e}",
                  f"{r['align']:9d}"]
        print(" ".join(cells))
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
