package kv_test

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvtier/hosttier"
)

// BenchmarkSwap swaps a Llama-3-8B sequence (2 MiB granules on a pool that keeps its
// idle granules, Blocked) out into the host tier and back, and in the same loop, in
// alternating order, copies as many bytes with Go's copy into buffers of the Go heap
// (1 GiB at most, copied over) and back: the floor of any swap. The target is a swap at ≥ 0.8× that copy's
// bandwidth at 32K tokens. Every token is checked bit-exact after the first round.
// Reported: swap-GB/s and memcpy-GB/s (bytes moved out and in over the time), and
// ratio (swap bandwidth over memcpy's, from the sums of both times).
func BenchmarkSwap(b *testing.B) {
	for _, tokens := range []int{4096, 32768} {
		b.Run(fmt.Sprintf("tokens=%d", tokens), func(b *testing.B) { benchSwap(b, tokens) })
	}
}

// swapPattern fills p with the bytes of layer's kind tensor's tokens from tok on.
func swapPattern(p []byte, layer int, kind kv.Kind, tok int) {
	for i := range p {
		p[i] = byte(i + 31*tok + 7*layer + int(kind))
	}
}

func benchSwap(b *testing.B, tokens int) {
	m := kv.Llama3_8B()
	granule := 2 << 20
	bytesPer := m.BytesPerToken() * tokens
	e := openEnv(b, onShared, withGranule(granule),
		withShared(host.SharedOptions{Populate: true, High: bytesPer/granule + 64, Decay: host.SharedNoDecay}),
		withName("kv-bench-swap"), withConfig(kv.Config{Model: m, MaxTokens: tokens}))
	tier, err := hosttier.New(hosttier.Options{Budget: int64(bytesPer) + 256<<20, Granule: 2 << 20, NoEvict: true})
	if err != nil {
		b.Fatal(err)
	}
	defer tier.Close()
	s, err := e.c.NewSequence()
	if err != nil {
		b.Fatal(err)
	}
	defer func() { s.Close() }()
	if err := s.Append(tokens); err != nil {
		b.Fatal(err)
	}
	tb := m.Groups[0].TokenBytes()
	const run = 1024
	buf := make([]byte, run*tb)
	for layer := range m.Layers {
		for _, kind := range []kv.Kind{kv.K, kv.V} {
			for t := 0; t < tokens; t += run {
				swapPattern(buf, layer, kind, t)
				if err := s.WriteTokens(layer, kind, t, t+run, buf); err != nil {
					b.Fatal(err)
				}
			}
		}
	}
	check := func() {
		for layer := range m.Layers {
			for _, kind := range []kv.Kind{kv.K, kv.V} {
				want := make([]byte, run*tb)
				for t := 0; t < tokens; t += run {
					swapPattern(want, layer, kind, t)
					if err := s.ReadTokens(layer, kind, t, t+run, buf); err != nil {
						b.Fatal(err)
					}
					if !bytes.Equal(buf, want) {
						b.Fatalf("layer %d %v tokens [%d, %d) differ after the swap", layer, kind, t, t+run)
					}
				}
			}
		}
	}
	ctx := context.Background()
	swap := func() time.Duration {
		start := time.Now()
		h, err := e.c.SwapOut(ctx, s, tier)
		if err != nil {
			b.Fatal(err)
		}
		if s, err = e.c.SwapIn(ctx, h); err != nil {
			b.Fatal(err)
		}
		return time.Since(start)
	}
	// NB: buffers of at most 1 GiB, copied over as often as the swap's bytes take,
	// so that the benchmark's memory stays within a shared machine's: a copy of that
	// size runs at the memory's bandwidth as a larger one does.
	piece := min(bytesPer, 1<<30)
	src, dst := make([]byte, piece), make([]byte, piece)
	for i := range src {
		src[i] = byte(i)
	}
	copy(dst, src)
	memcpy := func() time.Duration {
		start := time.Now()
		for done := 0; done < bytesPer; done += piece {
			n := min(piece, bytesPer-done)
			copy(dst[:n], src[:n])
			copy(src[:n], dst[:n])
		}
		return time.Since(start)
	}
	swap() // warm the tier's memory and the pool's parked granules
	check()
	var tSwap, tCopy time.Duration
	b.SetBytes(2 * int64(bytesPer))
	i := 0
	for b.Loop() {
		if i%2 == 0 {
			tSwap += swap()
			tCopy += memcpy()
		} else {
			tCopy += memcpy()
			tSwap += swap()
		}
		i++
	}
	check()
	moved := 2 * float64(bytesPer) * float64(i)
	b.ReportMetric(moved/tSwap.Seconds()/1e9, "swap-GB/s")
	b.ReportMetric(moved/tCopy.Seconds()/1e9, "memcpy-GB/s")
	b.ReportMetric(tCopy.Seconds()/tSwap.Seconds(), "ratio")
}
