package nodepool

import (
	"encoding/binary"
	"fmt"
)

// The wire protocol. Every message is one SOCK_SEQPACKET record: a 40-byte header and
// n 8-byte granule ids, little-endian.
//
//	offset size field
//	0      1    op       (a reply sets replyBit)
//	1      1    code     (replies: codeOK or an error code; requests: 0)
//	2      2    reserved (0)
//	4      4    n        (granule ids that follow the header, at most maxBatch)
//	8      8    id       (the request's id; a reply carries its request's)
//	16     8    a        (per operation)
//	24     8    b
//	32     8    c
//
// Requests (client to owner) and their replies:
//
//	hello  a=protocolVersion                 reply a=granule size, b=client number
//	alloc  a=granules (1..maxBatch),         reply n ids and n memfds (SCM_RIGHTS);
//	       b=deadline (unix ns; 0: do not       or codeBudget a=requested, b=available,
//	       wait; noDeadline: wait until          c=limit; codeCanceled; codeDeadline;
//	       cancelled)                           codeNoMemory a=errno
//	free   n ids (1..maxBatch)               no reply; codeProtocol and the end of
//	                                            the connection if one is not the
//	                                            sender's or comes twice
//	cancel a=id of a pending alloc           no reply (the alloc replies)
//	stats                                    reply a=node used, b=node limit, c=owned
//	lend   a=client number, n ids it holds   reply codeOK: that client may borrow them;
//	                                            or codeNoMemory a=errno (the owner
//	                                            could not open a granule's read-only
//	                                            descriptor, made at its first lend)
//	borrow n ids lent to the sender          reply the n ids and n read-only memfds
//	                                            (O_RDONLY, one per granule, made at
//	                                            its first lend); or codeGone a=id: a
//	                                            granule lent to the sender is gone
//	                                            (its lender gave it back first);
//	                                            codeBorrowed a=id: the sender borrows
//	                                            it already. Either borrows nothing
//	idle   a=granules the sender keeps idle   no reply: the owner counts them idle on
//	       (pooled, charged, mapped nowhere)    the sender's ledger, at most the
//	                                            granules it holds
//
// One request goes the other way, owner to client, when a request waits for the
// node's budget (see owner_reclaim_linux.go):
//
//	reclaim a=bytes wanted (> 0),            reply a=bytes given back (the frees
//	        b=stageIdle: idle granules;         come first on the socket); at most
//	        stagePrefix: idle granules, then    one unanswered per client, and one
//	        what the process's reclaimers       unanswered after reclaimTimeout is
//	        give back (cached prefixes)         counted and no longer waited for
//
// A client may have at most maxPending (64) allocs waiting at once. Only alloc
// replies carry descriptors; a request that carries any is a protocol
// violation (the owner closes what arrived, then the connection).
const (
	protocolVersion = 2 // 2: idle and reclaim
	headerLen       = 40
	maxBatch        = 64 // granules per alloc or free message; under SCM_MAX_FD (253)
	maxMsg          = headerLen + 8*maxBatch
	noDeadline      = ^uint64(0)
	// maxPending bounds the allocs one client may have waiting at once: each is a
	// goroutine and a queue entry in the owner. One more is a protocol violation.
	maxPending = 64
)

const (
	opHello  uint8 = 1
	opAlloc  uint8 = 2
	opFree   uint8 = 3
	opCancel uint8 = 4
	opStats  uint8 = 5
	opLend   uint8 = 6
	opBorrow uint8 = 7
	opIdle   uint8 = 8
	// opReclaim is the owner's request to a client: the one request a client
	// answers.
	opReclaim uint8 = 9
	replyBit  uint8 = 0x80
)

// The stages of a reclaim (its b operand): what the client is asked to give back.
const (
	stageIdle   uint64 = 1 // idle pooled granules only
	stagePrefix uint64 = 2 // idle granules, then what its reclaimers free: cached prefixes, never a live token
)

const (
	codeOK       uint8 = 0
	codeBudget   uint8 = 1 // the budget refused: a=requested, b=available, c=limit
	codeCanceled uint8 = 2
	codeDeadline uint8 = 3
	codeNoMemory uint8 = 4 // the owner could not create the memory
	codeProtocol uint8 = 5 // the request broke the protocol; the owner closes
	codeClosed   uint8 = 6 // the owner is closing
	codeVersion  uint8 = 7 // hello with a version the owner does not speak
	codeRefused  uint8 = 8 // the peer's user is not served
	// codeGone and codeBorrowed answer a borrow that names a granule lent to the
	// sender but gone, or one it borrows already. NB: no new protocol version: an
	// owner of version 2 ended the connection where these come, and a client of
	// version 2 ends it on a code it does not know, so neither side meets them
	// unless the other knows them (docs/node.md).
	codeGone     uint8 = 9
	codeBorrowed uint8 = 10
	maxCode            = codeBorrowed
)

// msg is one decoded message.
type msg struct {
	op, code uint8
	id       uint64
	a, b, c  uint64
	ids      []uint64
}

// encode appends m's wire form to dst.
func (m *msg) encode(dst []byte) []byte {
	var h [headerLen]byte
	h[0], h[1] = m.op, m.code
	binary.LittleEndian.PutUint32(h[4:], uint32(len(m.ids)))
	binary.LittleEndian.PutUint64(h[8:], m.id)
	binary.LittleEndian.PutUint64(h[16:], m.a)
	binary.LittleEndian.PutUint64(h[24:], m.b)
	binary.LittleEndian.PutUint64(h[32:], m.c)
	dst = append(dst, h[:]...)
	for _, id := range m.ids {
		dst = binary.LittleEndian.AppendUint64(dst, id)
	}
	return dst
}

// decode parses one message, checking only its framing: the length, the reserved
// bytes, the id count and that op and code are ones the protocol knows. What the
// fields mean for each op is checked by whoever serves it.
func decode(p []byte) (msg, error) {
	if len(p) < headerLen {
		return msg{}, fmt.Errorf("%w: message of %d bytes, shorter than the %d-byte header", ErrProtocol, len(p), headerLen)
	}
	m := msg{op: p[0], code: p[1]}
	if p[2] != 0 || p[3] != 0 {
		return msg{}, fmt.Errorf("%w: reserved header bytes are not zero", ErrProtocol)
	}
	if op := m.op &^ replyBit; op < opHello || op > opReclaim {
		return msg{}, fmt.Errorf("%w: unknown operation %#x", ErrProtocol, m.op)
	}
	if m.code > maxCode || (m.op&replyBit == 0 && m.code != 0) {
		return msg{}, fmt.Errorf("%w: code %d on operation %#x", ErrProtocol, m.code, m.op)
	}
	n := binary.LittleEndian.Uint32(p[4:])
	if n > maxBatch {
		return msg{}, fmt.Errorf("%w: %d granule ids, more than %d", ErrProtocol, n, maxBatch)
	}
	if len(p) != headerLen+8*int(n) {
		return msg{}, fmt.Errorf("%w: message of %d bytes for %d granule ids", ErrProtocol, len(p), n)
	}
	m.id = binary.LittleEndian.Uint64(p[8:])
	m.a = binary.LittleEndian.Uint64(p[16:])
	m.b = binary.LittleEndian.Uint64(p[24:])
	m.c = binary.LittleEndian.Uint64(p[32:])
	if n > 0 {
		m.ids = make([]uint64, n)
		for i := range m.ids {
			m.ids[i] = binary.LittleEndian.Uint64(p[headerLen+8*i:])
		}
	}
	return m, nil
}
