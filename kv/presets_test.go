package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/vmarena/vmarena/kv"
)

// TestSmallPresets: the small models' K/V per token, from their published configs
// (layers × KV heads × head dim × 2 bytes × K and V).
func TestSmallPresets(t *testing.T) {
	assert.Equal(t, 16*8*64*2*2, kv.Llama32_1B().BytesPerToken()) // 32 KiB
	assert.Equal(t, 24*2*64*2*2, kv.Qwen25_05B().BytesPerToken()) // 12 KiB
	for _, name := range []string{"llama3.2-1b", "Qwen2.5-0.5B"} {
		_, err := kv.Preset(name)
		assert.NoError(t, err, name)
	}
}
