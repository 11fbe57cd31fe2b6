package nodepool

// Encode returns the wire form of a message, for tests that play a hostile peer.
func Encode(op, code uint8, id, a, b, c uint64, ids []uint64) []byte {
	return (&msg{op: op, code: code, id: id, a: a, b: b, c: c, ids: ids}).encode(nil)
}

// Decode parses a message's header fields, for tests.
func Decode(p []byte) (op, code uint8, id, a uint64, ids []uint64, err error) {
	m, err := decode(p)
	return m.op, m.code, m.id, m.a, m.ids, err
}

const (
	OpHello, OpAlloc, OpFree, OpCancel, OpStats, ReplyBit = opHello, opAlloc, opFree, opCancel, opStats, replyBit
	OpLend, OpBorrow                                      = opLend, opBorrow
	OpIdle, OpReclaim, StageIdle, StagePrefix             = opIdle, opReclaim, stageIdle, stagePrefix
	CodeOK, CodeProtocol, CodeGone, CodeBorrowed          = codeOK, codeProtocol, codeGone, codeBorrowed
	MaxBatch, MaxMsg, HeaderLen, ProtocolVersion          = maxBatch, maxMsg, headerLen, protocolVersion
	MaxPending                                            = maxPending
)
