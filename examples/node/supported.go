package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/vmarena/vmarena/backing/nodepool"
)

// supported returns nil where a node pool can run, and otherwise an error that says
// what does not run here, wrapping errors.ErrUnsupported.
func supported() error {
	dir, err := os.MkdirTemp("", "vmarena-node-probe")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	o, err := nodepool.Listen(filepath.Join(dir, "probe.sock"), nodepool.OwnerOptions{})
	if errors.Is(err, errors.ErrUnsupported) {
		return fmt.Errorf("the node pool needs Linux: it passes each granule as a memfd, which this system does not have "+
			"(kv and one process's own budget run here, examples/kvcache shows them): %w", err)
	}
	if err != nil {
		return err
	}
	return o.Close()
}
