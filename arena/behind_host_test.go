//go:build linux || windows

package arena_test

import (
	"testing"

	"github.com/vmarena/vmarena/backing/host"
)

func TestBufferLeaveBehindHost(t *testing.T) {
	onHost(t, testLeaveBehind[*host.PrivateReservation, *host.Private], testLeaveBehind[*host.SharedReservation, *host.Shared])
}
