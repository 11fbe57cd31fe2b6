package main

import (
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/vmarena/vmarena/kvevents"
	"github.com/vmarena/vmarena/kvevents/kvsub"
)

// publisherOptions are a replica's publisher's: loopback only, on ports the system
// picks, with a replay buffer that keeps a whole replay, so that a router that
// connects late catches up from the first message.
func publisherOptions(id int) kvevents.Options {
	return kvevents.Options{
		Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", Topic: fmt.Sprintf("kv@replica-%d", id),
		ReplayBatches: 1 << 20, ReplayBytes: 1 << 30, QueueEvents: 1 << 20,
	}
}

// subscription is a router's stream of one replica's events into its index.
type subscription struct {
	r    int
	sub  *kvsub.Subscriber
	next atomic.Uint64 // the sequence number of the next batch to apply
	err  atomic.Pointer[error]
	done chan struct{}
}

// subscribe starts applying pub's events, as replica r's, to x: from the first one
// the replay socket keeps when catchUp is set, else from the next one published.
func subscribe(x *Index, r int, pub *kvevents.Publisher, catchUp bool) (*subscription, error) {
	sub, err := kvsub.Dial(kvsub.Options{Endpoint: pub.Endpoint(), ReplayEndpoint: pub.ReplayEndpoint(),
		Topic: fmt.Sprintf("kv@replica-%d", r), CatchUp: catchUp,
		// A catch-up replays every batch a replica kept: bounded by the time the
		// router gives its subscriptions to catch up, not by the 5 s default that a
		// loaded machine passed in the middle of a replay.
		Timeout: syncTimeout})
	if err != nil {
		return nil, err
	}
	s := &subscription{r: r, sub: sub, done: make(chan struct{})}
	go s.loop(x)
	return s, nil
}

func (s *subscription) loop(x *Index) {
	defer close(s.done)
	for {
		b, err := s.sub.Next()
		if errors.Is(err, kvsub.ErrClosed) {
			return
		}
		if err != nil {
			s.err.Store(&err)
			return
		}
		for _, e := range b.Events {
			var err error
			switch e.Kind {
			case kvsub.Stored:
				err = x.Stored(s.r, e.Hashes, e.Parent, e.HasParent, e.Tokens, e.BlockSize, e.ExtraKeys)
			case kvsub.Removed:
				err = x.Removed(s.r, e.Hashes)
			case kvsub.Cleared:
				x.Cleared(s.r)
			}
			if err != nil {
				s.err.Store(&err)
			}
		}
		s.next.Store(b.Seq + 1)
	}
}

// close stops the stream.
func (s *subscription) close() error {
	err := s.sub.Close()
	<-s.done
	return err
}

// caughtUp waits until the subscriptions applied every batch their publishers sent
// by now, each publisher's queue first drained: the router then routes on the
// replicas' state as of this moment. It fails after timeout, or with a stream's error.
func caughtUp(subs []*subscription, pubs []*kvevents.Publisher, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for i, s := range subs {
		for {
			if p := s.err.Load(); p != nil {
				return fmt.Errorf("replica %d's events: %w", s.r, *p)
			}
			st := pubs[i].Stats()
			if st.QueueDepth == 0 && st.Events == st.Published+st.Dropped && s.next.Load() >= uint64(st.Batches) {
				if st.Dropped > 0 {
					return fmt.Errorf("replica %d's publisher dropped %d events", s.r, st.Dropped)
				}
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("router: replica %d's events not in after %v (%d of %d batches)", s.r, timeout, s.next.Load(), st.Batches)
			}
			time.Sleep(20 * time.Microsecond)
		}
	}
	return nil
}

// wire is the router's side of the network: one subscription a replica.
type wire struct{ subs []*subscription }

func (w *wire) bytes() int64 {
	var n int64
	for _, s := range w.subs {
		n += s.sub.Stats().Bytes
	}
	return n
}

func (w *wire) close() error {
	var errs []error
	for _, s := range w.subs {
		errs = append(errs, s.close())
	}
	return errors.Join(errs...)
}
