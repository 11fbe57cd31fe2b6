// Package tierval is the value a kv cache writes into a tier below the device for one
// block (kv.Tier), and the key it writes it under: a header, the tokens the block was
// made for and the block's bytes, sealed with a CRC-32C, so that a value read back is
// checked in full before any of its bytes is mapped. value.go has the format, byte by
// byte; groups.go the value of a model of several layer groups (each group's part of a
// block, under the groups' layout, refused under another with ErrLayout).
//
// The cache encodes and decodes every value itself; a Tier stores them as opaque
// bytes and needs nothing here but Key and ErrSize. Encode, Decode and Size are for
// tools and tests that read or write a tier's values outside a cache.
//
// The package imports nothing of kv; kv imports it.
package tierval
