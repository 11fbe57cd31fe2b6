package kv

// Names kept out of kv's API, which a server author does not call, for the tests
// that check them: the panic values of misuse, and the tier defaults of
// PrefixCacheOptions.
const (
	PanicSequenceClosed  = panicSequenceClosed
	PanicPrefixReleased  = panicPrefixReleased
	PanicNilContext      = panicNilContext
	PanicNilPrefix       = panicNilPrefix
	PanicNilSequence     = panicNilSequence
	PanicPinReleased     = panicPinReleased
	PanicLayerRange      = panicLayerRange
	PanicRefCount        = panicRefCount
	PanicEventsOutOfStep = panicEventsOutOfStep

	DefaultTierStores = defaultTierStores
	TierThroughQueue  = tierThroughQueue
)
