// Package kvevents publishes a prefix cache's block events in vLLM's KV-event wire
// format, so that a cluster's router (llm-d's KV indexer, NVIDIA Dynamo, Mooncake
// Conductor) can send each request to the replica that holds its prefix. A
// [Publisher] is a [kv.BlockEvents]: the prefix cache tells it what it caches and
// evicts, and it puts batches of events on a ZeroMQ PUB socket, with an optional
// ROUTER socket that replays what a late or lossy subscriber missed.
//
// It is the only package of vmarena that imports a wire format (msgpack, through
// github.com/vmihailenco/msgpack/v5) or speaks ZeroMQ (through its own
// internal/zmtp, pure Go: see that package for why not go-zeromq/zmq4).
//
// # Use
//
//	pub, err := kvevents.New(kvevents.Options{
//		Endpoint:       "tcp://127.0.0.1:5557", // the default
//		ReplayEndpoint: "tcp://127.0.0.1:5558", // optional
//		Topic:          "kv@replica-0",
//	})
//	if err != nil { ... }         // ErrEndpoint, ErrListen, ErrOptions
//	defer pub.Close()
//	// pass pub as the prefix cache's kv.BlockEvents
//
// Or, for a router whose SUB socket binds and which every engine's publisher
// connects to (llm-d's "global socket"), name it in Connect instead of Endpoint:
//
//	pub, err := kvevents.New(kvevents.Options{
//		Connect: "tcp://kv-indexer:5557", // dialled, and dialled again when lost
//		Topic:   "kv@replica-0@model",
//	})
//
// docs/events.md shows how llm-d and NVIDIA Dynamo are pointed at a replica.
//
// # Wire format
//
// As vLLM's ZmqEventPublisher sends it (vllm/distributed/kv_events.py). The form of
// the payload changed between vLLM releases; each decision below names the release
// it follows (docs/events.md lists them, with the routers that read each):
//
//   - Each message is three frames: the topic (Options.Topic, UTF-8), the sequence
//     number as 8 bytes big-endian (0, 1, 2, ... one per message), and the payload.
//   - The payload is an EventBatch, a msgspec Struct with array_like=True in every
//     release from the file's first (vLLM's PR 16750) to v0.26.0, so a
//     positional array: [ts (float64 seconds since the Unix epoch), events,
//     data_parallel_rank]. The rank's default is None, which omit_defaults would leave
//     out, but vLLM's publisher always sets it, and so does this one: the array always
//     has 3 elements.
//   - Each event is a KVCacheEvent Struct with tag=True and omit_defaults=True. In
//     v0.26.0 (after vLLM's change to map-encoded events) it is not array_like: a map
//     whose first key is "type", the class name, followed by the fields in their
//     declared order, a field with a default omitted while it holds it. In v0.23.0 and
//     before it is array_like too: an array whose first element is the class name,
//     followed by the fields in their declared order, the defaulted ones that trail
//     omitted. Options.VLLM023Events picks the older form; the default is v0.26.0's.
//     A field without a default is always present (None as nil). So:
//   - BlockStored: type, block_hashes ([uint64]), parent_block_hash (uint64, or nil
//     for a chain's first block), token_ids ([int], len(block_hashes)*block_size of
//     them), block_size, lora_id (deprecated by vLLM: always nil here), medium ("GPU"
//     or "CPU"), lora_name (nil for none), then extra_keys (one entry per block, nil
//     or an array; omitted from a map when no block has any, nil in an array),
//     group_idx (always sent: the group's index in the kv.Model), kv_cache_spec_kind
//     and kv_cache_spec_sliding_window. The kind is named from
//     kv.BlocksStored.Attention as vLLM's get_kv_cache_spec_kind names a spec
//     (vllm/v1/kv_cache_interface.py): "full_attention", "mla_attention",
//     "sliding_window", "chunked_local_attention"; omitted when the event has none.
//     The window is sent for a sliding window alone, as
//     get_kv_cache_spec_sliding_window gives it (a chunked-local group's chunk is no
//     window): omitted otherwise. vLLM sets both on every BlockStored
//     (KVCacheManager.take_events, vllm/v1/core/kv_cache_manager.py), and a prefix
//     cache's events carry them for every group, one-group models included.
//   - BlockRemoved: type, block_hashes, medium, group_idx (no spec: vLLM's carries
//     none).
//   - AllBlocksCleared: type alone.
//
// Integers take msgpack's shortest form, as msgspec writes them; a hash of 2^63 or
// more is a uint64.
//
// Replay: the ROUTER socket takes a request [empty frame, start sequence number as
// 8 bytes big-endian] from a DEALER and answers with every kept message from that
// number on, each as [empty, seq, payload], then the end marker [empty, -1 as 8
// signed big-endian bytes, empty]. vLLM drops a request of another shape with a
// log line; so does this package, and counts it (Stats.BadRequests).
//
// Where this package differs from vLLM's publisher, on purpose:
//   - Whether it binds or dials out is said by Options (Endpoint or Connect), not
//     guessed from the endpoint: vLLM binds when the endpoint has a "*" or "::" and
//     otherwise connects out.
//   - Nobody gets in by default: the default endpoint is tcp://127.0.0.1:5557, loopback
//     only, where vLLM's is tcp://*:5557. Name "*" or an interface to be reachable.
//   - vLLM's queue blocks the engine when full; this one drops the event and counts it
//     (Stats.Dropped), since the cache must never wait for a subscriber.
//   - A request with a start number that is not exactly 8 bytes is malformed here.
//   - The cache never wakes the publishing goroutine: it polls the queue every
//     FlushInterval (1 ms) while events come, and up to 64 intervals apart once quiet,
//     so an event waits up to 64 ms after a quiet spell. (Waking a goroutine costs the
//     caller microseconds; queueing an event, tens of nanoseconds.)
//   - Without a replay socket no replay buffer is kept.
//
// # Bounds
//
// Nothing a peer does makes this process grow without bound or publishing wait:
// the event queue (Options.QueueEvents), the replay buffer (ReplayBatches and
// ReplayBytes), each subscriber's queue (SubscriberQueue), the connections
// (MaxSubscribers per socket, each closed unless its handshake ends within
// HandshakeTimeout; with Connect, one dialled connection, each dial and handshake
// bounded by HandshakeTimeout and the tries spaced by a back-off from
// ReconnectInterval to MaxReconnect) and the replays streaming at once
// (MaxReplays) are all bounded;
// what is read from a peer beyond a small frame is skipped unread into memory. A
// stalled subscriber fills its own queue and then loses messages (counted in
// Stats.SubscriberDrops); the others, and the cache, go on. It sees the gap in the
// sequence numbers, and can ask the replay socket for what it missed.
//
// # Memory management
//
// A Publisher keeps the slices of the events it is given (the cache hands them over
// and never touches them again) until they are encoded, then drops them. Payloads are
// shared by the replay buffer and the subscribers' queues, never copied per
// subscriber. Close releases the sockets and goroutines; a Publisher must be closed.
//
// # Concurrency
//
// BlocksStored, BlocksRemoved, AllBlocksCleared, Stats, Endpoint and ReplayEndpoint
// may be called from any goroutine, at once; the event methods never block beyond a
// short mutex (the queue's) and wake no goroutine. Close must be called once; events
// after it are dropped. Locks: the queue's, the replay buffer's and the PUB socket's
// subscriber list are each taken alone, never one inside another, except that
// publishing holds the PUB socket's list while it takes each subscriber's
// subscription lock (in that order only).
package kvevents
