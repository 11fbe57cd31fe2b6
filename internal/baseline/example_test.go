package baseline_test

import (
	"fmt"

	"github.com/vmarena/vmarena/internal/baseline"
)

// Three sequences start on a 32-token shared prefix and grow to 100 tokens under each
// strategy; Physical shows what each holds for the same tokens.
func Example() {
	shape := baseline.Shape{Layers: 2, TokenBytes: 64, MaxTokens: 1024}
	eager, _ := baseline.NewEager(shape, baseline.EagerOptions{})
	paged, _ := baseline.NewPaged(shape, baseline.PagedOptions{ChunkBlocks: 1})
	appnd, _ := baseline.NewAppend(shape, baseline.AppendOptions{})
	for _, st := range []baseline.Strategy{eager, paged, appnd} {
		root, _ := st.NewSequence()
		_ = root.Append(32)
		prefix, _ := root.Freeze(32)
		_ = root.Close()
		var seqs []baseline.Sequence
		for range 3 {
			q, _ := st.NewSequenceFrom(prefix)
			_ = q.Append(100 - q.Len())
			seqs = append(seqs, q)
		}
		prefix.Release()
		s := st.Stats()
		fmt.Printf("%-6s tokens %d, physical %6d B, saved by sharing %5d B\n", st.Name(), s.Tokens, s.Physical, s.Saved)
		for _, q := range seqs {
			_ = q.Close()
		}
		_ = st.Close()
	}
	// Output:
	// eager  tokens 300, physical 786432 B, saved by sharing     0 B
	// paged  tokens 300, physical  69632 B, saved by sharing 16384 B
	// append tokens 300, physical  78336 B, saved by sharing     0 B
}
