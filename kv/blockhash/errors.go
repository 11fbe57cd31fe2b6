package blockhash

import "errors"

// ErrConfig is returned by New for options it can not use: a server sees it at
// start-up, from a bad flag or configuration.
var ErrConfig = errors.New("blockhash: bad options")

// Panics on misuse.
const (
	// PanicBlockLength: Block was passed a number of tokens other than BlockSize.
	PanicBlockLength = "blockhash: a block holds exactly BlockSize tokens"
	// PanicExtraKey: an extra key of a type the CBOR encoder does not know.
	PanicExtraKey = "blockhash: extra keys are strings, []byte, integers, nil or []any of them"
)
