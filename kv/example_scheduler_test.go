package kv_test

import (
	"errors"
	"fmt"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
)

// request is one generation request of the scheduler below.
type request struct {
	id, prompt, total int
	seq               *kv.Sequence
}

// server is what a continuous-batching server holds: no field names a backing type.
type server struct {
	cache   *kv.Cache
	waiting []*request // FIFO
	running []*request
}

// admit starts waiting requests, oldest first, while their prompts fit now: what a
// prompt needs (Need, the pool's idle granules counted) against the cache's Headroom
// (the governor's free bytes and what eviction of cached prefixes would give back).
func (sv *server) admit() error {
	for len(sv.waiting) > 0 {
		r := sv.waiting[0]
		s, err := sv.cache.NewSequence()
		if err != nil {
			return err
		}
		if need, err := s.Need(r.prompt); err != nil || need > sv.cache.Headroom() {
			s.Close()
			return err // nil: no room now; try again after a step
		}
		if err := s.Append(r.prompt); err != nil { // prefill (K/V writes omitted)
			s.Close()
			return err
		}
		r.seq = s
		sv.waiting = sv.waiting[1:]
		sv.running = append(sv.running, r)
	}
	return nil
}

// step decodes one token for every running request, all or nothing. On a refusal it
// preempts the newest request (its memory is given back; it starts again later) until
// the step fits. It returns the preemptions.
func (sv *server) step() (int, error) {
	preempted := 0
	for len(sv.running) > 0 {
		batch := make([]kv.Growth, len(sv.running))
		for i, r := range sv.running {
			batch[i] = kv.Growth{Seq: r.seq, Tokens: 1}
		}
		err := sv.cache.AppendBatch(batch)
		var refused *accounting.BudgetError
		if !errors.As(err, &refused) {
			return preempted, err
		}
		// refused.Requested - refused.Available bytes are missing: free the newest.
		last := sv.running[len(sv.running)-1]
		sv.running = sv.running[:len(sv.running)-1]
		last.seq.Close()
		last.seq = nil
		sv.waiting = append([]*request{last}, sv.waiting...)
		preempted++
	}
	return preempted, nil
}

// finish closes the requests that reached their length.
func (sv *server) finish() int {
	done := 0
	kept := sv.running[:0]
	for _, r := range sv.running {
		if r.seq.Len() == r.total {
			r.seq.Close()
			done++
			continue
		}
		kept = append(kept, r)
	}
	sv.running = kept
	return done
}

// A continuous-batching loop on a memory budget: admit requests whose prompts fit,
// grow the whole batch one token per step, preempt the newest request when a step is
// refused, close requests as they finish.
func ExampleCache_AppendBatch() {
	const granule = 64 << 10
	gov := accounting.NewGovernor()
	_ = gov.SetLimit(accounting.HostKey, 10*granule)
	mem, err := host.NewPrivate(host.PrivateOptions{Granularity: granule})
	if err != nil {
		panic(err)
	}
	// kv.Tiny()'s tokens take 256 bytes in all: a 64 KiB granule holds 256 of them.
	cache, err := kv.New(mem, kv.Config{
		Model:     kv.Tiny(),
		MaxTokens: 4096,
		Authority: gov.Authority("kv", accounting.HostKey),
	})
	if err != nil {
		panic(err)
	}
	defer cache.Close()

	sv := &server{cache: cache}
	for id := range 8 {
		sv.waiting = append(sv.waiting, &request{id: id, prompt: 300, total: 700})
	}
	steps, done, preempted := 0, 0, 0
	for len(sv.waiting)+len(sv.running) > 0 {
		if err := sv.admit(); err != nil {
			panic(err)
		}
		p, err := sv.step()
		if err != nil {
			panic(err)
		}
		preempted += p
		done += sv.finish()
		steps++
	}
	fmt.Printf("%d requests done in %d steps, %d preemptions\n", done, steps, preempted)
	fmt.Printf("peak %d KiB of a %d KiB budget, %d KiB held now\n",
		gov.Stats(accounting.HostKey).Peak>>10, gov.Limit(accounting.HostKey)>>10, gov.Stats(accounting.HostKey).Used>>10)
	// Output:
	// 8 requests done in 1200 steps, 4 preemptions
	// peak 640 KiB of a 640 KiB budget, 0 KiB held now
}
