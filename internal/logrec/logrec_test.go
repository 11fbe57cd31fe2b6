package logrec_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/internal/logrec"
)

func TestRecorder(t *testing.T) {
	var r logrec.Recorder
	assert.Empty(t, r.Records())
	l := r.Logger()
	l.Debug("one", "n", 1)
	l.With("k", "v").WithGroup("g").Warn("two", "bytes", int64(2<<20))
	recs := r.Records()
	require.Len(t, recs, 2)
	assert.Equal(t, []string{"one", "two"}, r.Messages())
	assert.Equal(t, "DEBUG", recs[0]["level"])
	assert.Equal(t, float64(1), recs[0]["n"])
	two := r.Find("two")
	require.Len(t, two, 1)
	assert.Equal(t, "v", two[0]["k"])
	assert.Equal(t, map[string]any{"bytes": float64(2 << 20)}, two[0]["g"])
	assert.Empty(t, r.Find("three"))
}
