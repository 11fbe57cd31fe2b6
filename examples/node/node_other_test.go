//go:build !linux

package main

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

// TestUnsupported: without memfd the command stops at once and says why.
func TestUnsupported(t *testing.T) {
	err := run(context.Background(), []string{"-trace", testTrace}, &strings.Builder{}, &strings.Builder{})
	assert.ErrorIs(t, err, errors.ErrUnsupported)
	assert.ErrorContains(t, err, "needs Linux")
}
