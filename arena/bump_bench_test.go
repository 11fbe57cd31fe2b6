package arena_test

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/vmarena/vmarena/arena"
)

// layerGeometry is one transformer layer's forward step: Llama-3-8B's shapes for a
// batch of sequences that each add qLen tokens while attending to kvLen.
type layerGeometry struct {
	name                                   string
	batch, qLen, kvLen                     int
	hidden, inter, heads, kvHeads, headDim int
}

var (
	// decodeStep: 8 sequences each generate one token against 1,024 of context.
	decodeStep = layerGeometry{"decode", 8, 1, 1024, 4096, 14336, 32, 8, 128}
	// prefillStep: 8 sequences each take in a 128-token prompt chunk.
	prefillStep = layerGeometry{"prefill", 8, 128, 128, 4096, 14336, 32, 8, 128}
)

type tensorSpec struct {
	dtype arena.DType
	shape []int
}

func (s tensorSpec) elems() int {
	n := 1
	for _, d := range s.shape {
		n *= d
	}
	return n
}

// specs returns the layer's activations: 12 in F16 and 4 in float32 (the residual
// stream, attention scores and the RoPE table kept in full precision).
func (g layerGeometry) specs() []tensorSpec {
	t := g.batch * g.qLen
	f16 := func(shape ...int) tensorSpec { return tensorSpec{arena.Float16, shape} }
	f32 := func(shape ...int) tensorSpec { return tensorSpec{arena.Float32, shape} }
	return []tensorSpec{
		f32(t, g.hidden),                       // residual in
		f16(t, g.hidden),                       // attention RMSNorm
		f16(t, g.heads, g.headDim),             // q
		f16(t, g.kvHeads, g.headDim),           // k
		f16(t, g.kvHeads, g.headDim),           // v
		f32(t, 2, g.headDim/2),                 // RoPE cos/sin
		f32(g.batch, g.heads, g.qLen, g.kvLen), // attention scores
		f16(g.batch, g.heads, g.qLen, g.kvLen), // attention probabilities
		f16(t, g.heads*g.headDim),              // attention output
		f16(t, g.hidden),                       // o projection
		f32(t, g.hidden),                       // residual after attention
		f16(t, g.hidden),                       // MLP RMSNorm
		f16(t, g.inter),                        // gate
		f16(t, g.inter),                        // up
		f16(t, g.inter),                        // SiLU(gate) * up
		f16(t, g.hidden),                       // down
	}
}

func (g layerGeometry) bytes() int {
	n := 0
	for _, s := range g.specs() {
		n += s.elems() * s.dtype.Size()
	}
	return n
}

// layerStep allocates one step's activations.
type layerStep struct {
	specs []tensorSpec
}

func newLayerStep(g layerGeometry) layerStep { return layerStep{g.specs()} }

// Sinks keep make's slices on the heap, as a real step's would be.
var (
	sinkF16 [16][]arena.F16
	sinkF32 [16][]float32
)

// arena takes every tensor from a, touches its first element, and resets a.
func (s layerStep) arena(a *hostArena) error { return s.arenaStep(a, false) }

func (s layerStep) arenaStep(a *hostArena, zero bool) error {
	for _, sp := range s.specs {
		switch sp.dtype {
		case arena.Float16:
			v, err := arena.MakeTensor[arena.F16](a, sp.shape...)
			if err != nil {
				return err
			}
			x, err := v.Slice()
			if err != nil {
				return err
			}
			if zero {
				clear(x)
			}
			x[0] = 1
		case arena.Float32:
			v, err := arena.MakeTensor[float32](a, sp.shape...)
			if err != nil {
				return err
			}
			x, err := v.Slice()
			if err != nil {
				return err
			}
			if zero {
				clear(x)
			}
			x[0] = 1
		}
	}
	return a.Reset()
}

// make allocates every tensor with make, touches its first element, and drops it.
func (s layerStep) make() {
	for i, sp := range s.specs {
		switch sp.dtype {
		case arena.Float16:
			x := make([]arena.F16, sp.elems())
			x[0] = 1
			sinkF16[i] = x
		case arena.Float32:
			x := make([]float32, sp.elems())
			x[0] = 1
			sinkF32[i] = x
		}
	}
	sinkF16, sinkF32 = [16][]arena.F16{}, [16][]float32{}
}

// BenchmarkLayerStep allocates one layer's activation set per step, by make (which
// zeroes and leaves the rest to the GC) and by an Arena with Reset (which does
// neither; arena+clear zeroes too, for a like-for-like comparison).
func BenchmarkLayerStep(b *testing.B) {
	for _, g := range []layerGeometry{decodeStep, prefillStep} {
		step := newLayerStep(g)
		bytes := g.bytes()
		run := func(b *testing.B, do func()) {
			// NB: no SetBytes: bytes handed out per second is no throughput for an arena
			// that touches one element of each tensor; MiB/step says the size.
			b.ReportAllocs()
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			for b.Loop() {
				do()
			}
			runtime.ReadMemStats(&after)
			b.ReportMetric(float64(after.NumGC-before.NumGC)/float64(b.N)*10000, "GCs/10k-steps")
			b.ReportMetric(float64(bytes)/(1<<20), "MiB/step")
		}
		b.Run(fmt.Sprintf("phase=%s/alloc=make", g.name), func(b *testing.B) {
			run(b, step.make)
		})
		for _, zero := range []bool{false, true} {
			name := "arena"
			if zero {
				name = "arena+clear"
			}
			b.Run(fmt.Sprintf("phase=%s/alloc=%s", g.name, name), func(b *testing.B) {
				a, _ := newHostArena(b, 2*bytes+(1<<20), arena.ArenaOptions{})
				if err := step.arenaStep(a, zero); err != nil { // commit once, as a server's first step would
					b.Fatal(err)
				}
				run(b, func() {
					if err := step.arenaStep(a, zero); err != nil {
						b.Fatal(err)
					}
				})
			})
		}
	}
}
