package kvevents_test

import (
	"fmt"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvevents"
)

// Example publishes what a prefix cache would report: two blocks stored, one
// removed. A router subscribes to p.Endpoint() and asks p.ReplayEndpoint() for what
// it missed; the prefix cache is handed p as its kv.BlockEvents.
func Example() {
	p, err := kvevents.New(kvevents.Options{
		Endpoint:       "tcp://127.0.0.1:0", // loopback, a port the system picks
		ReplayEndpoint: "tcp://127.0.0.1:0",
		Topic:          "kv@replica-0",
	})
	if err != nil {
		panic(err)
	}
	var events kv.BlockEvents = p
	events.BlocksStored(kv.BlocksStored{
		Hashes:    []uint64{0x1111, 0x2222},
		Tokens:    make([]int32, 2*16),
		BlockSize: 16,
		Medium:    "CPU",
	})
	events.BlocksRemoved(kv.BlocksRemoved{Hashes: []uint64{0x2222}, Medium: "CPU"})
	if err := p.Close(); err != nil { // publishes what is queued
		panic(err)
	}
	s := p.Stats()
	fmt.Printf("%d events published, %d dropped\n", s.Published, s.Dropped)
	// Output: 2 events published, 0 dropped
}
