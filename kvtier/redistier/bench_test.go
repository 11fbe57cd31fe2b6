package redistier_test

import (
	"context"
	"testing"
	"time"

	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/redistier"
)

// BenchmarkRoundTrip stores and loads one 2 MiB block on a redis-server on loopback:
// via=tier through the Tier (Store's fill copies the block into the tier's buffer,
// as the cache copies its granules; Load's use copies it out, as the cache copies it
// into fresh granules), via=setget through the same client's plain SET of the
// block's bytes and GET, copied out. via=both alternates the two in one loop and
// reports tier/setget, their ratio measured side by side.
func BenchmarkRoundTrip(b *testing.B) {
	const size = 2 << 20
	s := startServer(b, false)
	c := newClient(b, s.addr())
	tier, err := redistier.New(c, redistier.Options{Timeout: 10 * time.Second})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	blk := make([]byte, size)
	for i := range blk {
		blk[i] = byte(i * 7)
	}
	out := make([]byte, size)
	key := tierval.Key{Namespace: 1, Hash: 2}
	plainKey := "plain:block"
	viaTier := func() {
		if err := tier.Store(ctx, key, size, func(dst []byte) error { copy(dst, blk); return nil }); err != nil {
			b.Fatal(err)
		}
		if err := tier.Load(ctx, key, func(src []byte) error { copy(out, src); return nil }); err != nil {
			b.Fatal(err)
		}
	}
	viaSetGet := func() {
		if err := c.Set(ctx, plainKey, blk, 0).Err(); err != nil {
			b.Fatal(err)
		}
		v, err := c.Get(ctx, plainKey).Bytes()
		if err != nil {
			b.Fatal(err)
		}
		copy(out, v)
	}
	b.Run("via=tier", func(b *testing.B) {
		b.SetBytes(2 * size)
		for b.Loop() {
			viaTier()
		}
	})
	b.Run("via=setget", func(b *testing.B) {
		b.SetBytes(2 * size)
		for b.Loop() {
			viaSetGet()
		}
	})
	b.Run("via=both", func(b *testing.B) {
		var inTier, inPlain time.Duration
		for b.Loop() {
			t0 := time.Now()
			viaTier()
			t1 := time.Now()
			viaSetGet()
			inPlain += time.Since(t1)
			inTier += t1.Sub(t0)
		}
		b.ReportMetric(float64(inTier)/float64(inPlain), "tier/setget")
		b.ReportMetric(float64(inTier.Microseconds())/float64(b.N), "tier-us/op")
		b.ReportMetric(float64(inPlain.Microseconds())/float64(b.N), "setget-us/op")
	})
}
