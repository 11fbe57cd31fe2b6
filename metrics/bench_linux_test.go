package metrics_test

import (
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/metrics"
)

// The scrape benchmarks' scenario: 1,000 live sequences of the tiny model on a
// memfd pool of 64 KiB granules (256 tokens each), decoding one token per step
// round-robin; a sequence that reaches benchMax tokens is closed and replaced by a
// fresh one with a benchPrompt-token prompt (the server's churn).
const (
	benchLive   = 1000
	benchPrompt = 200
	benchMax    = 1024
)

type benchServer struct {
	gov   *accounting.Governor
	pool  *host.Shared
	cache *kv.Cache
	seqs  []*kv.Sequence
	reg   *prometheus.Registry
	noKV  *prometheus.Registry // the governor and the pool only
	next  int
}

func newBenchServer(b *testing.B) *benchServer {
	b.Helper()
	gov := accounting.NewGovernor()
	auth := gov.Authority("kv", accounting.HostKey)
	pool, err := host.NewShared(host.SharedOptions{Granularity: 64 << 10, Authority: auth, High: 4096, Name: "vmarena-metrics-bench"})
	if err != nil {
		b.Fatal(err)
	}
	cache, err := kv.New(pool, kv.Config{Model: kv.Tiny(), MaxTokens: benchMax})
	if err != nil {
		b.Fatal(err)
	}
	c, err := metrics.New(metrics.Options{
		Governor: gov,
		Pools:    []metrics.Pool{{Name: "kv", Pool: pool}},
		Caches:   []metrics.Cache{{Name: "tiny", Cache: cache, Device: accounting.HostKey, Pool: pool}},
	})
	if err != nil {
		b.Fatal(err)
	}
	s := &benchServer{gov: gov, pool: pool, cache: cache, reg: prometheus.NewRegistry(), noKV: prometheus.NewRegistry()}
	s.reg.MustRegister(c)
	nc, err := metrics.New(metrics.Options{Governor: gov, Pools: []metrics.Pool{{Name: "kv", Pool: pool}}})
	if err != nil {
		b.Fatal(err)
	}
	s.noKV.MustRegister(nc)
	for i := range benchLive {
		// Stagger the lengths so that replacements spread over the run.
		s.seqs = append(s.seqs, s.start(b, benchPrompt+i*(benchMax-benchPrompt)/benchLive))
	}
	b.Cleanup(func() {
		for _, q := range s.seqs {
			q.Close()
		}
		if err := cache.Close(); err != nil {
			b.Error(err)
		}
		if err := pool.Close(); err != nil {
			b.Error(err)
		}
	})
	return s
}

func (s *benchServer) start(b *testing.B, tokens int) *kv.Sequence {
	q, err := s.cache.NewSequence()
	if err != nil {
		b.Fatal(err)
	}
	if err := q.Append(tokens); err != nil {
		b.Fatal(err)
	}
	return q
}

// step is the token path: one decode step of the next sequence. It returns whether
// the sequence was full, and then replaces it (not timed as a token).
func (s *benchServer) step(b *testing.B) (time.Duration, bool) {
	q := s.seqs[s.next]
	if q.Len() == benchMax {
		q.Close()
		s.seqs[s.next] = s.start(b, benchPrompt)
		s.next = (s.next + 1) % benchLive
		return 0, false
	}
	t0 := time.Now()
	if err := q.Append(1); err != nil {
		b.Fatal(err)
	}
	d := time.Since(t0)
	s.next = (s.next + 1) % benchLive
	return d, true
}

// BenchmarkScrape is the cost of one scrape (Gather of the governor, the pool and
// the cache) with 1,000 live sequences.
func BenchmarkScrape(b *testing.B) {
	s := newBenchServer(b)
	for b.Loop() {
		if _, err := s.reg.Gather(); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(s.cache.Stats().Sequences), "live-seqs")
}

// BenchmarkTokenPath times each decode step of the token path with 1,000 live
// sequences: with no scrape; with a scraper gathering this server's metrics every
// millisecond (15,000 times Prometheus' default rate) or back to back on another
// goroutine; and, as the control, back to back from a second, idle server of the
// same size, which shares no lock or data with the token path; and back to back
// without the cache (the governor and the pool only), which leaves the sequences'
// counters alone. What the control moves is the scraper's CPU and garbage, not
// blocking. It reports the steps' p50 and p99 and the scrapes done.
func BenchmarkTokenPath(b *testing.B) {
	for _, tt := range []struct {
		name     string
		scrape   bool
		interval time.Duration
		other    bool
		noKV     bool
	}{
		{"scrape=off", false, 0, false, false},
		{"scrape=1ms", true, time.Millisecond, false, false},
		{"scrape=busy", true, 0, false, false},
		{"scrape=busy-other", true, 0, true, false},
		{"scrape=busy-nokv", true, 0, false, true},
	} {
		b.Run(tt.name, func(b *testing.B) {
			s := newBenchServer(b)
			reg := s.reg
			if tt.other {
				reg = newBenchServer(b).reg
			}
			if tt.noKV {
				reg = s.noKV
			}
			var stop atomic.Bool
			var scrapes atomic.Int64
			var wg sync.WaitGroup
			if tt.scrape {
				wg.Go(func() {
					for !stop.Load() {
						if _, err := reg.Gather(); err != nil {
							b.Error(err)
							return
						}
						scrapes.Add(1)
						if tt.interval > 0 {
							time.Sleep(tt.interval)
						}
					}
				})
			}
			lat := make([]time.Duration, 0, 1<<20)
			for b.Loop() {
				if d, ok := s.step(b); ok {
					lat = append(lat, d)
				}
			}
			stop.Store(true)
			wg.Wait()
			slices.Sort(lat)
			pct := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))].Nanoseconds()) }
			b.ReportMetric(pct(0.50), "p50-ns")
			b.ReportMetric(pct(0.99), "p99-ns")
			b.ReportMetric(float64(scrapes.Load()), "scrapes")
		})
	}
}
