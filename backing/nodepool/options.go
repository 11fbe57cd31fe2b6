package nodepool

import (
	"os"
	"time"

	"github.com/vmarena/vmarena/accounting"
)

// OwnerOptions configures an [Owner].
type OwnerOptions struct {
	// Governor holds the node's budget: the owner charges each attached process's
	// granules to an authority of its own on it, on accounting.HostKey. nil makes a
	// fresh governor, Unlimited until its limit is set (Owner.Governor).
	Governor *accounting.Governor
	// Granularity is the granule size in bytes: a power of two and a multiple of the
	// page size. 0 means 2 MiB. Each granule is one memfd, one descriptor in the owner
	// and in its holder, and one mapping per place it is mapped (see the package
	// documentation, "Limits").
	Granularity int
	// Name is the memfds' name, shown in /proc/<pid>/maps as /memfd:Name. "" means
	// "vmarena-node".
	Name string
}

// ClientOptions configures a [Client].
type ClientOptions struct {
	// Authority is the process's own ledger of what it holds from the node, on
	// accounting.HostKey: Owned is its granules, Mapped its mappings. Its governor's
	// limit, if set, caps this process below the node's budget, and a commit waits
	// in its FIFO queue first, then in the owner's. nil makes one on a fresh
	// governor, Unlimited.
	Authority *accounting.Authority
	// High is the most idle granules the client keeps after their last mapping in
	// this process went: they stay charged (to the process's authority and, on the
	// owner, to its ledger, marked idle) and serve its next commits with no message
	// to the owner; the rest go back to the owner. 0 means 64; ClientNoPool (any
	// negative value) keeps none: every granule goes back with its last mapping. A
	// pooled granule keeps its contents (CommitZeroes is then false).
	High int
	// Low is the idle granules that decay leaves in the pool (it gives back only
	// those above Low); Prefill fills the pool, nothing refills it in the background.
	// A reclaim for a request that waits on the node, in this process or another,
	// takes idle granules below Low too. 0, the default, keeps none.
	Low int
	// Decay is how long an idle granule may stay unused before the client gives it
	// back to the owner, by host.SharedOptions.Decay's rule: the longest idle first,
	// all of them above Low by Decay after the load stops. 0 means 5 s;
	// ClientNoDecay (any negative value) keeps idle granules up to High until Trim,
	// Close or a reclaim takes them.
	Decay time.Duration
}

// ClientNoPool as ClientOptions.High keeps no idle granule: every granule goes
// back to the owner when its last mapping in the process goes.
const ClientNoPool = -1

// ClientNoDecay as ClientOptions.Decay turns decay off.
const ClientNoDecay = -1

// ClientStats is what the owner holds for one attached process.
type ClientStats struct {
	Number   uint64 // the client's number on this owner, from 1
	PID      int32  // the peer's process id (SO_PEERCRED)
	UID      uint32 // the peer's user id
	Granules int    // granules the client holds
	Borrowed int    // granules other clients lent it that it maps
	Owned    int64  // their bytes, charged to the client's authority
	Waiting  int    // allocations queued on the budget
	Idle     int    // of Granules, those it reports idle (pooled, mapped nowhere)
	// Reclaims counts the reclaims the owner sent it (see NodeStats.Reclaim).
	Reclaims uint64
}

// ReclaimStats counts the owner's reclaims: requests to attached processes to give
// back idle granules, then cached prefixes, for a request that waits on the node.
type ReclaimStats struct {
	Asked      uint64 // reclaim requests sent
	AskedBytes int64  // the bytes they asked for
	Answered   uint64 // requests answered in time
	Given      int64  // the bytes the answers said came back
	// Short counts answers that gave back less of a stage-one request (idle
	// granules) than asked: the process's idle report was stale, or a lie. The
	// shortfall is asked of every process's cached prefixes.
	Short uint64
	// Unanswered counts requests not answered within the bound (500 ms): the owner
	// stops waiting for them, and asks for the rest elsewhere as for Short.
	Unanswered uint64
	Late       uint64 // answers that came after their request was counted unanswered
}

// NodeStats is a snapshot of the node: its budget and each attached process.
// NB: a process is attached, and listed, once the owner has read its hello, on a
// goroutine of its own and possibly after the process hung up; an empty Clients
// does not mean that a process that has just hung up is gone. Detached counts
// every attached process once it is: wait for that count instead.
type NodeStats struct {
	Device   accounting.DeviceStats // the node's host budget
	Granule  int                    // granule size
	Granules int                    // live granules: held, or borrowed after their holder let go
	Clients  []ClientStats          // by client number
	Detached uint64                 // clients that have come and gone
	Reclaim  ReclaimStats           // cumulative, since Listen
}

const (
	defaultGranularity = 2 << 20
	defaultName        = "vmarena-node"
	maxSocketPath      = 107 // sun_path holds 108 bytes with its NUL
	defaultHigh        = 64  // as host.SharedOptions.High
	defaultDecay       = 5 * time.Second
)

func checkGranularity(g int) error {
	if g <= 0 || g&(g-1) != 0 || g%os.Getpagesize() != 0 {
		return errorf(ErrInvalidOption, "granularity %d is not a power of two multiple of the %d-byte page", g, os.Getpagesize())
	}
	return nil
}

// Usage is what the owner says of the node and of this process.
type Usage struct {
	NodeUsed  int64 // bytes every attached process holds
	NodeLimit int64 // the node's budget (accounting.Unlimited if never set)
	Owned     int64 // bytes this process holds, as the owner counts them
}

// listenOptions validates Listen's arguments and fills in the defaults.
func listenOptions(path string, opts OwnerOptions) (OwnerOptions, error) {
	if opts.Granularity == 0 {
		opts.Granularity = defaultGranularity
	}
	if err := checkGranularity(opts.Granularity); err != nil {
		return opts, err
	}
	if err := checkPath(path); err != nil {
		return opts, err
	}
	if opts.Name == "" {
		opts.Name = defaultName
	}
	if len(opts.Name) > 249 { // memfd_create(2): longer names fail with EINVAL
		return opts, errorf(ErrInvalidOption, "memfd name of %d bytes, more than 249", len(opts.Name))
	}
	if opts.Governor == nil {
		opts.Governor = accounting.NewGovernor()
	}
	return opts, nil
}

// attachOptions validates Attach's arguments and fills in the defaults.
func attachOptions(path string, opts ClientOptions) (ClientOptions, error) {
	if err := checkPath(path); err != nil {
		return opts, err
	}
	switch {
	case opts.High == 0:
		opts.High = defaultHigh
	case opts.High < 0:
		opts.High = 0
	}
	switch {
	case opts.Decay == 0:
		opts.Decay = defaultDecay
	case opts.Decay < 0:
		opts.Decay = 0
	}
	if opts.Low < 0 {
		return opts, errorf(ErrInvalidOption, "Low %d is negative", opts.Low)
	}
	if opts.Authority == nil {
		opts.Authority = accounting.NewGovernor().Authority("node client", accounting.HostKey)
	} else if opts.Authority.Device() != accounting.HostKey {
		return opts, errorf(ErrInvalidOption, "authority on %v, not the host", opts.Authority.Device())
	}
	return opts, nil
}

func checkPath(path string) error {
	if path == "" || len(path) > maxSocketPath {
		return errorf(ErrInvalidOption, "socket path %q: must be 1 to %d bytes", path, maxSocketPath)
	}
	return nil
}
