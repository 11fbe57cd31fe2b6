// Package redistier is a [kv.Tier] over Redis or Valkey, through the caller's
// go-redis client (github.com/redis/go-redis/v9): a store of cold prefix blocks that
// every replica of a server reads.
//
// [New] takes a [redis.UniversalClient], so a single server, a Redis Cluster, Sentinel
// failover, TLS and ACLs are the caller's configuration, made the go-redis way. A block
// is one string value under a key of its own, prefix + namespace + hash in hex, with no
// hash tag, so a cluster spreads the blocks of one prefix over all its slots. Contains
// asks EXISTS of every key in one pipeline: one round trip to each node that holds one.
//
// # Failure is a miss
//
// Every call runs under a timeout of its own (Options.Timeout). An error of the network
// or of the server (not a missing key) trips a short back-off (Options.Backoff): until
// it ends, every call fails at once with [ErrUnavailable] without touching the network,
// so that a server that is down costs the cache one timeout, not one per block. Loads
// then fail (the cache counts them as misses), stores are dropped and counted, and
// the caller goes on. The first call after the back-off tries the server again.
//
// NB: go-redis applies a context's deadline to reads and writes on a connection only
// when the client's options set ContextTimeoutEnabled; without it a call to a server
// that stops answering (rather than refusing) waits for the client's ReadTimeout or
// WriteTimeout (3 s by default). Set ContextTimeoutEnabled, or short socket timeouts,
// in the client given to New.
//
// # Memory management
//
// Store fills a buffer of the tier's own, taken from a pool and given back when the
// SET returns: the fill func must not keep it. Load hands use the bytes of the GET
// reply, which go-redis allocated for that call; they are valid only during use. The
// tier holds nothing else; Close is the client's, and the caller's.
//
// # Concurrency
//
// A Tier is safe for concurrent use, as the go-redis client is. Its counters are
// atomic, so [Tier.Stats] may be read at any time; a snapshot is consistent per
// counter, not across counters.
package redistier
