package filetier_test

import (
	"fmt"
	"os"
	"time"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvtier/filetier"
)

// A server that restarts comes back warm: its first run writes each cached prompt's
// blocks through to files, and the next run, a new cache and a new tier on the same
// directory, loads them instead of prefilling the prompt again. A run under another
// namespace (here another TierPrefix, as another model revision would be) ignores
// them.
func Example_restart() {
	dir, err := os.MkdirTemp("", "filetier-example")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	prompt := make([]int32, 1000)
	for i := range prompt {
		prompt[i] = int32(1000 + i)
	}
	// run is one life of a server: it serves the prompt once and stops.
	run := func(revision string) int {
		pool, err := host.NewShared(host.SharedOptions{
			Granularity: 64 << 10,
			Authority:   accounting.NewGovernor().Authority("kv", accounting.HostKey),
		})
		if err != nil {
			panic(err)
		}
		defer pool.Close()
		cfg := kv.Config{Model: kv.Llama32_1B(), MaxTokens: 4096}
		cache, err := kv.New(pool, cfg)
		if err != nil {
			panic(err)
		}
		defer cache.Close()
		// The tier serves this cache's namespace only, so that it ignores (and
		// logs) the blocks of any other model, layout or revision in dir.
		ns, err := kv.TierNamespace(cfg, pool.Granularity(), revision)
		if err != nil {
			panic(err)
		}
		tier, err := filetier.New(filetier.Options{Dir: dir, Budget: 256 << 20, Namespace: ns, Logger: quiet})
		if err != nil {
			panic(err)
		}
		defer tier.Close()
		pc, err := kv.NewPrefixCache(cache, kv.PrefixCacheOptions{
			Tiers:            []kv.Tier{tier},
			TierPrefix:       revision,
			TierWriteThrough: true,             // store blocks as they are cached
			TierWait:         10 * time.Second, // a wait no machine runs out of
		})
		if err != nil {
			panic(err)
		}
		defer pc.Close()
		s, cached, err := pc.Lookup(prompt)
		if err != nil {
			panic(err)
		}
		// Prefill the uncached part (its K/V writes omitted), then cache the prompt.
		if err := s.Append(len(prompt) - cached); err != nil {
			panic(err)
		}
		if err := pc.Insert(s, prompt); err != nil {
			panic(err)
		}
		s.Close()
		return cached
	}
	fmt.Println("first start:", run("rev 1"), "tokens cached")
	fmt.Println("restart:", run("rev 1"), "tokens cached")
	fmt.Println("another revision:", run("rev 2"), "tokens cached")
	// Output:
	// first start: 0 tokens cached
	// restart: 998 tokens cached
	// another revision: 0 tokens cached
}
