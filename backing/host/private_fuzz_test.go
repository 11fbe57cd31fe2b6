package host_test

import (
	"os"
	"testing"

	"github.com/vmarena/vmarena/backing/backingtest"
	"github.com/vmarena/vmarena/backing/host"
)

// FuzzPrivate drives random operation sequences against a page-granule Private
// backing and the suite's model.
func FuzzPrivate(f *testing.F) {
	for _, seed := range backingtest.SeedOps() {
		f.Add(seed)
	}
	p, err := host.NewPrivate(host.PrivateOptions{Granularity: os.Getpagesize()})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, ops []byte) {
		backingtest.RunOps(t, p, ops)
	})
}
