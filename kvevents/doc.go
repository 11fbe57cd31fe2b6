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
// For a router whose SUB socket binds and which every engine's publisher connects to
// (llm-d's "global socket"), name it in Options.Connect instead of Endpoint: it is
// dialled, and dialled again when lost. docs/events.md shows how llm-d and NVIDIA
// Dynamo are pointed at a replica, in both modes.
//
// # Wire format
//
// As vLLM's ZmqEventPublisher sends it (vllm/distributed/kv_events.py): three frames,
// the topic, an 8-byte big-endian sequence number and a msgpack EventBatch, in
// v0.26.0's form by default and v0.23.0's with Options.VLLM023Events. docs/events.md
// lists each decision with the vLLM release it follows and where this package differs
// from vLLM's publisher on purpose; encode.go and replay.go tell the fields and the
// replay protocol byte by byte.
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
