package main

import (
	"errors"
	"time"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvevents"
)

// cluster is the replicas of one mode and the router's view of them.
type cluster struct {
	cfg    simConfig
	mode   string
	idx    *Index
	reps   []*replica
	pubs   []*kvevents.Publisher // nil in process
	wire   *wire                 // nil in process
	counts *countingIndex
}

// syncTimeout bounds how long the router waits for events already published.
const syncTimeout = 30 * time.Second

// newCluster starts the replicas of mode (one holding every budget, batch and prefill
// rate for modeSingle), each publishing its events over ZMQ on loopback
// (transportZMQ) or handing them to the router's index in process, and the router's
// subscriptions.
func newCluster(cfg simConfig, mode, transport string) (c *cluster, err error) {
	if mode == modeSingle {
		cfg.Budget *= int64(cfg.Replicas)
		cfg.Concurrency *= cfg.Replicas
		cfg.PrefillRate *= float64(cfg.Replicas)
		cfg.Replicas = 1
	}
	c = &cluster{cfg: cfg, mode: mode, counts: &countingIndex{}}
	defer func() {
		if err != nil {
			err = errors.Join(err, c.close())
		}
	}()
	if c.idx, err = NewIndex(cfg.Replicas, cfg.BlockSize, "router"); err != nil {
		return c, err
	}
	for i := range cfg.Replicas {
		var obs kv.BlockEvents = feed{x: c.idx, r: i}
		if transport == transportZMQ {
			pub, err := kvevents.New(publisherOptions(i))
			if err != nil {
				return c, err
			}
			c.pubs = append(c.pubs, pub)
			obs = pub
		}
		r, err := newReplica(i, cfg, c.counts.wrap(obs))
		if err != nil {
			return c, err
		}
		c.reps = append(c.reps, r)
	}
	if transport == transportZMQ {
		c.wire = &wire{}
		for i, pub := range c.pubs {
			// Catching up from the first message: nothing is missed while the
			// subscription takes effect.
			s, err := subscribe(c.idx, i, pub, true)
			if err != nil {
				return c, err
			}
			c.wire.subs = append(c.wire.subs, s)
		}
	}
	return c, nil
}

// policy returns the mode's routing: by prefix (waiting for the events made so far
// before each decision) or round-robin (one replica: always it).
func (c *cluster) policy(sc Scorer) policy {
	if c.mode != modePrefix {
		return &roundRobin{n: len(c.reps)}
	}
	return &byPrefix{idx: c.idx, scorer: sc, sync: c.caughtUp}
}

// caughtUp returns once the router's index has every event the replicas' caches
// made so far: each cache's events goroutine has told its observer (the publisher,
// or the index in process), and over ZMQ the router has read what was published.
func (c *cluster) caughtUp() error {
	for _, r := range c.reps {
		r.pc.FlushEvents()
	}
	if c.wire != nil {
		return caughtUp(c.wire.subs, c.pubs, syncTimeout)
	}
	return nil
}

// settle waits until the router has every event published, and checks the index
// applied them all.
func (c *cluster) settle() error {
	if err := c.caughtUp(); err != nil {
		return err
	}
	if n := c.idx.Errors(); n > 0 {
		return errors.New("router: the index could not apply some events")
	}
	return nil
}

// close closes the router's subscriptions, the replicas and their publishers.
func (c *cluster) close() error {
	var errs []error
	if c.wire != nil {
		errs = append(errs, c.wire.close())
	}
	for _, r := range c.reps {
		errs = append(errs, r.close())
	}
	for _, p := range c.pubs {
		errs = append(errs, p.Close())
	}
	return errors.Join(errs...)
}
