// Package kvsub reads vLLM's KV events, as package kvevents or a vLLM engine publishes
// them: it subscribes to a ZMQ PUB socket, decodes each batch into typed events (a
// positional batch whose events are maps, as vLLM v0.26.0 sends, or arrays, as
// v0.23.0 and before did), refuses a malformed batch rather than read it as empty,
// tells a gap in the sequence numbers, and fetches what was missed from the
// publisher's replay socket.
// It is what a router needs to keep an index of which replica holds which block;
// llm-d's indexer does the same with cgo ZMQ.
//
// # Use
//
//	sub, err := kvsub.Dial(kvsub.Options{Endpoint: "tcp://127.0.0.1:5557", ReplayEndpoint: "tcp://127.0.0.1:5558"})
//	...
//	for {
//		b, err := sub.Next() // in order, gaps filled from the replay socket
//		...
//	}
//
// Or bind, for publishers to connect to (llm-d's "global socket"; a
// kvevents.Publisher with Options.Connect), and read every one's batches under its
// topic:
//
//	l, err := kvsub.Listen(kvsub.Options{Endpoint: "tcp://127.0.0.1:5557", Topic: "kv@"})
//	...
//	m, err := l.Next() // m.Topic names the publisher; gaps reported, not filled
//
// # Memory management
//
// A Batch and its events are the caller's. What a publisher sends is read through
// the limits of Options (a largest frame, most frames a message): a larger message is
// skipped, not buffered, and reported as ErrMessage.
//
// # Concurrency
//
// A Subscriber or Listener is read by one goroutine at a time; Close may be called
// from any goroutine and makes a blocked Next return ErrClosed.
package kvsub
