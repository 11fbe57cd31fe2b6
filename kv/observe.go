package kv

import (
	"context"
	"log/slog"
)

// What the cache logs (Config.Logger): a range a failed release left with the cache,
// a summary of each eviction pass of its prefix cache, and a tier's value that failed
// its check on a load.

// evictReason says what an eviction pass of the prefix cache was for.
type evictReason uint8

const (
	evictForGrowth evictReason = iota // the cache's own growth was short of budget
	evictForWaiter                    // a request on the device waits (the reclaimer)
	evictForCaller                    // PrefixCache.Evict
)

func (r evictReason) String() string {
	switch r {
	case evictForWaiter:
		return "waiter"
	case evictForCaller:
		return "caller"
	}
	return "growth"
}

// evictTally is the prefix cache's eviction counters at one moment.
type evictTally struct{ tokens, granules, bytes int64 }

// evictMark returns the eviction counters now. pc.mu is held.
func (pc *PrefixCache) evictMark() evictTally {
	return evictTally{pc.evictedTokens, pc.evictions, pc.evictedBytes}
}

func (t evictTally) minus(u evictTally) evictTally {
	return evictTally{t.tokens - u.tokens, t.granules - u.granules, t.bytes - u.bytes}
}

// logEviction logs one eviction pass that took something: at Info for a waiter (the
// governor asked), at Debug for the cache's own growth, which may evict at every
// admission under pressure. pc.mu must not be held.
func (pc *PrefixCache) logEviction(why evictReason, need int64, done evictTally) {
	l := pc.c.cfg.Logger
	if l == nil || done.granules == 0 {
		return
	}
	level := slog.LevelDebug
	if why == evictForWaiter {
		level = slog.LevelInfo
	}
	if !l.Enabled(context.Background(), level) {
		return
	}
	l.Log(context.Background(), level, "kv: prefix cache eviction", "for", why.String(), "need_bytes", need,
		"tokens", done.tokens, "granules", done.granules, "freed_bytes", done.bytes)
}

// logInvalidTierValue logs, at Warn, a value tier i returned for block blk that
// failed tierval.Decode's check (err wraps tierval.ErrValue and says which check:
// truncated, format, checksum, namespace or block, and what differed). It is a miss
// and counted (TierStats.Invalid); the log says why, which the count can not: a torn
// store, another geometry, a key clash.
func logInvalidTierValue(l *slog.Logger, i, blk int, err error) {
	if l == nil {
		return
	}
	l.Warn("kv: prefix cache tier value failed its check", "tier", i, "block", blk, "err", err)
}
