// Package nodepool is one pool of host memory for every process on a node: one
// process, the [Owner], holds the node's budget (an accounting.Governor) and every
// physical granule; other processes [Attach] to it over a Unix domain socket and
// commit granules into address ranges of their own through a [Client], a
// backing.Backing. A process that does not attach works as before, on its own
// backings and governor.
//
// # Design
//
// Each granule is a memfd of its own, sealed against growing and shrinking, that the
// owner passes to the client it was allocated to alone (SCM_RIGHTS), checking every
// granule id a client names against the granules that client holds. Each process
// keeps its own reserved ranges and stable bases; only the physical memory is the
// node's. A process may lend granules it committed to another attached process
// ([Client.Lend]), which maps them read-only with no copy ([Client.Borrow]).
// cmd/vmarena-node runs an owner as a daemon.
//
// The protocol is one SOCK_SEQPACKET record per message (proto.go); the owner closes
// the connection at the first message it can not accept. docs/node.md tells the
// design, the protocol, who counts what, the faults and the figures.
//
// # Accounting
//
// The owner charges each client's granules to an accounting.Authority of its own on
// the node's governor (accounting.HostKey), named after the client's number and pid;
// [Owner.Stats] lists them, and the governor's Stats are the node's. A client's
// commit waits for the node's budget in the governor's one FIFO queue, with its
// context's deadline carried across the socket and a cancel message when the context
// ends first. A client also keeps its own ledger ([ClientOptions].Authority, under
// backing.ByBacking): Owned is the granules it committed, Mapped its mappings
// (borrowed granules included); a limit set on its governor caps the process below
// the node's budget, and is waited on first. A lent granule stays charged to its
// lender until its last borrower gives it back: owned once, mapped by many.
//
// # Memory that moves
//
// A client keeps the granules whose last mapping in it went in a pool of idle
// granules (ClientOptions.High, Low, Decay, as host.SharedOptions'), charged to it
// and marked idle on both ledgers, for its next commits; it reports their count to
// the owner and gives them back by host.Shared's decay. When a request waits for the
// node's budget, the owner asks the attached processes, across the socket, for idle
// granules first, then for cached prefixes (each process's reclaimers: a
// kv.PrefixCache evicts only what no live sequence maps), never for memory in use.
// The owner waits for no client: an answer that does not come within a bound, or
// gives less than the process reported idle, is counted ([NodeStats].Reclaim) and
// the rest asked of the others.
//
// # Memory management
//
// A client's reservations MUST be given back with Unreserve and the Client with
// Close; the Owner MUST be closed with Close, which removes its socket. A granule's
// memory lives while any descriptor or mapping of it does: the owner's descriptor
// and the client's go when the client gives it back (its last mapping in the client
// decommitted and the pool full, decayed, trimmed or reclaimed) or when its
// connection closes. So a killed client's granules go back
// to the budget as soon as the owner reads the end of its connection, and a killed
// owner leaves every client's mapped memory valid (no SIGBUS: the memfd is sealed
// against shrinking) until the client unmaps it; the client's next call that needs
// the owner fails with an error wrapping ErrOwnerGone, and a new owner may start on
// the same path (Listen removes a socket nobody answers on). Nothing is ever on
// disk or in /dev/shm: a memfd has no path.
//
// # Trust and limits
//
// The socket is made with mode 0600 and the owner serves only peers of its own uid
// (SO_PEERCRED); the per-granule memfds keep a client from reaching other processes'
// granules through the owner, not from the kernel's own same-user access
// (/proc/<pid>/mem, unless the process is undumpable: docs/node.md). A granule costs
// one descriptor in the owner and one in its holder (RLIMIT_NOFILE) and one kernel
// mapping per place it is mapped (vm.max_map_count): at 2 MiB granules a process maps
// at most about 128 GiB of them.
//
// # Concurrency
//
// Owner and Client are safe for concurrent use. The owner runs a goroutine per
// connection, reading it in a blocking recvmsg on a thread of its own, and one per
// allocation in flight; its lock (Owner.mu) is taken before the governor's. A
// Client's lock guards its reservations and is held across the mapping system
// calls, never across a request to the owner; replies are read by one goroutine
// at a time (a caller waiting for its reply, or a watcher while none waits) and
// matched to their requests by id (client_read_linux.go).
//
// Linux only: elsewhere Listen and Attach return errors wrapping
// errors.ErrUnsupported.
package nodepool
