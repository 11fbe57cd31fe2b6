package poll_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/vmarena/vmarena/internal/poll"
)

func TestBackoff(t *testing.T) {
	b := poll.Backoff{Interval: time.Millisecond, MaxPolls: 8}
	var got []time.Duration
	for _, busy := range []bool{false, false, false, false, false, true, false} {
		got = append(got, b.Next(busy))
	}
	ms := time.Millisecond
	assert.Equal(t, []time.Duration{ms, 2 * ms, 4 * ms, 8 * ms, 8 * ms, ms, 2 * ms}, got)
}
