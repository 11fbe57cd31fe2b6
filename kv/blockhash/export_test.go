package blockhash

// Payload returns the CBOR bytes Block hashes for a block.
func (h *Hasher) Payload(parent Hash, tokens []int32, extra []any) []byte {
	return h.payload(nil, parent, tokens, extra)
}
