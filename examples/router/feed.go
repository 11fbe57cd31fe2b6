package main

import "github.com/vmarena/vmarena/kv"

// feed hands replica r's block events straight to an index, in the replica's
// process (from its prefix cache's events goroutine): the view of a router with no network
// between it and the replicas, and the events' reference for the ZMQ path.
type feed struct {
	x *Index
	r int
}

var _ kv.BlockEvents = feed{}

func (f feed) BlocksStored(e kv.BlocksStored) {
	_ = f.x.Stored(f.r, e.Hashes, e.Parent, e.HasParent, e.Tokens, e.BlockSize, e.ExtraKeys) // counted in Errors
}

func (f feed) BlocksRemoved(e kv.BlocksRemoved) { _ = f.x.Removed(f.r, e.Hashes) }

func (f feed) AllBlocksCleared() { f.x.Cleared(f.r) }
