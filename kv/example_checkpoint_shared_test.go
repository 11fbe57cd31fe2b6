//go:build linux || windows

package kv_test

import (
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// On Qwen3-Next, whose Gated DeltaNet layers keep a state per sequence beside 12
// full-attention layers, a server records the states at each 512-token boundary of
// a prefill and inserts the prompt there; a conversation's next turn starts on the
// latest checkpoint it reaches, its states copied, and recomputes the tokens past it.
func ExampleSequence_Checkpoint() {
	gov := accounting.NewGovernor()
	_ = gov.SetLimit(accounting.HostKey, 4<<30)
	pool, err := host.NewShared(host.SharedOptions{
		Granularity: 2 << 20,
		Authority:   gov.Authority("kv", accounting.HostKey),
	})
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	cache, err := kv.New(pool, kv.Config{Model: kv.Qwen3Next80B(), MaxTokens: 8192})
	if err != nil {
		panic(err)
	}
	defer cache.Close()
	pc, err := kv.NewPrefixCache(cache, kv.PrefixCacheOptions{})
	if err != nil {
		panic(err)
	}
	defer pc.Close()

	turn := make([]int32, 1300) // the first turn's prompt
	for i := range turn {
		turn[i] = int32(i)
	}
	next := append(append([]int32{}, turn...), 1, 2, 3) // the next turn's
	for req, prompt := range [][]int32{turn, next} {
		s, cached, err := pc.Lookup(prompt)
		if err != nil {
			panic(err)
		}
		if err := s.Append(len(prompt) - cached); err != nil {
			panic(err)
		}
		for at := cached; at < len(prompt); {
			at = min(len(prompt), (at/512+1)*512)
			// ... the step computes the tokens up to at: their K/V, and the states.
			if at%512 == 0 {
				if err := s.Checkpoint(at); err != nil {
					panic(err)
				}
				if err := pc.Insert(s, prompt[:at]); err != nil {
					panic(err)
				}
			}
		}
		if err := pc.Insert(s, prompt); err != nil {
			panic(err)
		}
		fmt.Printf("request %d: %d of %d prompt tokens cached\n", req, cached, len(prompt))
		s.Close()
	}
	st := pc.Stats()
	fmt.Printf("%d checkpoints of %d MiB\n", st.Checkpoints, st.CheckpointBytes/int64(st.Checkpoints)>>20)
	// Output:
	// request 0: 0 of 1300 prompt tokens cached
	// request 1: 1024 of 1303 prompt tokens cached
	// 2 checkpoints of 38 MiB
}
