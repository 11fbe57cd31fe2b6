package accounting

import "fmt"

// Tier says what kind of memory a device has.
type Tier uint8

const (
	// Host is CPU memory.
	Host Tier = iota
	// Device is accelerator memory (a GPU's).
	Device
	// HostTier is host memory set aside for a tier of a cache below its device (cold
	// KV blocks): the same RAM as Host, under a budget of its own, so that filling the
	// tier never takes what the host's buffers were promised.
	HostTier
)

func (t Tier) String() string {
	switch t {
	case Host:
		return "host"
	case Device:
		return "device"
	case HostTier:
		return "host-tier"
	}
	return fmt.Sprintf("Tier(%d)", uint8(t))
}

// DeviceKey names one memory: a tier and an index within it (GPU ordinal; 0 for the host).
type DeviceKey struct {
	Tier  Tier
	Index int
}

// HostKey is the key of host memory.
var HostKey = DeviceKey{Tier: Host}

// GPU returns the key of GPU ordinal i.
func GPU(i int) DeviceKey { return DeviceKey{Tier: Device, Index: i} }

func (k DeviceKey) String() string { return fmt.Sprintf("%v:%d", k.Tier, k.Index) }
