package redistier_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kv/tierval"
	"github.com/vmarena/vmarena/kvtier/redistier"
)

// TestOneKeyNeverTorn: writers store values of one key at once, each its own payload,
// one of them with a timeout so short that its SETs fail (before or while they send:
// the test can not tell which), while another deletes
// the key and readers load it: every value read back passes tierval.Decode and is
// one writer's whole payload, or the key is missing. A torn value (a SET cut off, a
// pooled buffer reused while a SET still sent it) would fail the check.
func TestOneKeyNeverTorn(t *testing.T) {
	s := startServer(t, false)
	c := newClient(t, s.addr())
	tier := newTier(t, c, redistier.Options{Timeout: slow, Backoff: -1})
	hasty := newTier(t, c, redistier.Options{Timeout: 50 * time.Microsecond, Backoff: -1})
	const payload, writers, rounds = 1 << 20, 3, 20
	key := tierval.Key{Namespace: 9, Hash: 0xfeed}
	tokens := []int32{1, 2, 3, 4}
	size := tierval.Size(len(tokens), payload)
	store := func(tr *redistier.Tier, w int) error {
		return tr.Store(context.Background(), key, size, func(dst []byte) error {
			return tierval.Encode(dst, key, tokens, payload, func(p []byte) error {
				for i := 0; i+8 <= len(p); i += 8 {
					binary.LittleEndian.PutUint64(p[i:], uint64(w)<<32|uint64(i))
				}
				return nil
			})
		})
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tr := tier
			if w == 0 {
				tr = hasty
			}
			for range rounds {
				if err := store(tr, w); err != nil && tr == tier {
					assert.NoError(t, err)
				}
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for ctx.Err() == nil {
			assert.NoError(t, tier.Delete(context.Background(), key))
			time.Sleep(time.Millisecond)
		}
	}()
	var loads, misses int
	check := func() {
		err := tier.Load(context.Background(), key, func(src []byte) error {
			p, err := tierval.Decode(src, key, tokens, payload)
			if err != nil {
				return err
			}
			w := binary.LittleEndian.Uint64(p) >> 32
			for i := 0; i+8 <= len(p); i += 8 {
				if got := binary.LittleEndian.Uint64(p[i:]); got != w<<32|uint64(i) {
					return fmt.Errorf("word %d is %#x: two writers' bytes in one value", i/8, got)
				}
			}
			return nil
		})
		if errors.Is(err, kv.ErrTierMiss) {
			misses++
			return
		}
		require.NoError(t, err)
		loads++
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	for stop := false; !stop; {
		select {
		case <-done:
			stop = true
		default:
			check()
			if loads+misses >= 4*writers*rounds {
				cancel()
			}
		}
	}
	cancel()
	<-done
	require.NoError(t, store(tier, 1))
	check()
	assert.Positive(t, loads, "some loads found a value")
	t.Logf("%d values checked, %d misses; the hasty writer's tier: %+v", loads, misses, hasty.Stats())
}
