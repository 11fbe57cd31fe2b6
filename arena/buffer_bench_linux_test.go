package arena_test

import (
	"fmt"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing/host"
)

var granules = []int{64 << 10, 2 << 20}

func granuleName(g int) string {
	if g >= 1<<20 {
		return fmt.Sprintf("granule=%dMiB", g>>20)
	}
	return fmt.Sprintf("granule=%dKiB", g>>10)
}

// BenchmarkCommitGranule commits and decommits one granule: through a Buffer, with the
// raw syscalls a Buffer makes (the floor), and through a Buffer whose backing
// populates on commit.
func BenchmarkCommitGranule(b *testing.B) {
	for _, g := range granules {
		b.Run(granuleName(g), func(b *testing.B) {
			b.Run("impl=raw-syscall", func(b *testing.B) {
				mem, err := unix.Mmap(-1, 0, 4*g, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANON|unix.MAP_NORESERVE)
				if err != nil {
					b.Fatal(err)
				}
				defer unix.Munmap(mem)
				r := mem[g : 2*g]
				b.SetBytes(int64(g))
				for b.Loop() {
					if err := unix.Mprotect(r, unix.PROT_READ|unix.PROT_WRITE); err != nil {
						b.Fatal(err)
					}
					if err := unix.Madvise(r, unix.MADV_DONTNEED); err != nil {
						b.Fatal(err)
					}
					if err := unix.Mprotect(r, unix.PROT_NONE); err != nil {
						b.Fatal(err)
					}
				}
			})
			for _, populate := range []bool{false, true} {
				name := "impl=buffer"
				if populate {
					name = "impl=buffer-populate"
				}
				b.Run(name, func(b *testing.B) {
					p, err := host.NewPrivate(host.PrivateOptions{Granularity: g, Populate: populate})
					if err != nil {
						b.Fatal(err)
					}
					buf, err := arena.NewBuffer(p, 4*g, accounting.NewGovernor().Authority("bench", accounting.HostKey))
					if err != nil {
						b.Fatal(err)
					}
					defer buf.Close()
					b.SetBytes(int64(g))
					for b.Loop() {
						if err := buf.Resize(g); err != nil {
							b.Fatal(err)
						}
						if err := buf.Resize(0); err != nil {
							b.Fatal(err)
						}
					}
				})
			}
		})
	}
}

// BenchmarkGrowTensor grows one Llama-3-8B K tensor (2 KiB per token) to 8,192 tokens,
// writing each token as it comes: through a Buffer, with Go append, into one eager
// allocation of the final size outside the Go heap (arena.Eager), and into one make.
func BenchmarkGrowTensor(b *testing.B) {
	const tokens, tokenBytes = 8192, 2048
	token := make([]byte, tokenBytes)
	for i := range token {
		token[i] = byte(i)
	}
	for _, g := range granules {
		b.Run("impl=buffer/"+granuleName(g), func(b *testing.B) {
			p, err := host.NewPrivate(host.PrivateOptions{Granularity: g})
			if err != nil {
				b.Fatal(err)
			}
			auth := accounting.NewGovernor().Authority("bench", accounting.HostKey)
			b.SetBytes(tokens * tokenBytes)
			for b.Loop() {
				buf, err := arena.NewBuffer(p, tokens*tokenBytes, auth)
				if err != nil {
					b.Fatal(err)
				}
				for t := range tokens {
					if err := buf.Resize((t + 1) * tokenBytes); err != nil {
						b.Fatal(err)
					}
					copy(buf.Bytes()[t*tokenBytes:], token)
				}
				if out := buf.Close(); !out.OK() {
					b.Fatal(out)
				}
			}
			b.ReportMetric(0, "base-moves/op")
		})
	}
	b.Run("impl=append", func(b *testing.B) {
		b.SetBytes(tokens * tokenBytes)
		moves, spare := 0, 0
		for b.Loop() {
			var s []byte
			for range tokens {
				old := unsafe.SliceData(s)
				s = append(s, token...)
				if old != nil && old != unsafe.SliceData(s) {
					moves++
				}
			}
			spare = cap(s) - len(s)
		}
		b.ReportMetric(float64(moves)/float64(b.N), "base-moves/op")
		b.ReportMetric(100*float64(spare)/float64(tokens*tokenBytes), "spare%")
	})
	b.Run("impl=eager", func(b *testing.B) {
		p, err := host.NewPrivate(host.PrivateOptions{Granularity: 2 << 20})
		if err != nil {
			b.Fatal(err)
		}
		e, err := arena.NewEager(p, accounting.NewGovernor().Authority("bench", accounting.HostKey))
		if err != nil {
			b.Fatal(err)
		}
		b.SetBytes(tokens * tokenBytes)
		for b.Loop() {
			a, err := e.Allocate(tokens*tokenBytes, 4096)
			if err != nil {
				b.Fatal(err)
			}
			s := e.Bytes(a)
			for t := range tokens {
				copy(s[t*tokenBytes:], token)
			}
			if out := e.Release(a); !out.OK() {
				b.Fatal(out)
			}
		}
		b.ReportMetric(0, "base-moves/op")
	})
	b.Run("impl=make", func(b *testing.B) {
		b.SetBytes(tokens * tokenBytes)
		for b.Loop() {
			s := make([]byte, tokens*tokenBytes)
			for t := range tokens {
				copy(s[t*tokenBytes:], token)
			}
		}
		b.ReportMetric(0, "base-moves/op")
	})
}
