package main

import (
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/vmarena/vmarena/kv"
)

// LoRA adapters in the prefix-cache replay (-adapters): request i is served under
// adapter i mod N. The same prompt gives other K/V under another adapter, so no hit may
// cross adapters: vmarena's prefix cache keeps each adapter's entries in a kv.Namespace
// of its own, and the paged baseline, which has no namespaces, sees each adapter's
// prompts under token IDs of its own (apart). The ideal is an unbounded cache per
// adapter: the trace's hash ids made distinct per adapter.

// maxAdapters bounds -adapters: apart shifts token IDs by a Vocabulary per adapter,
// which must stay within an int32.
const maxAdapters = 1024

// padapter is the adapter a request is served under.
type padapter struct {
	index int          // in [0, Adapters), 0 without adapters
	ns    kv.Namespace // its namespace in vmarena's prefix cache: the default without adapters
	shift int32        // what apart adds to its token IDs: 0 for adapter 0 and without adapters
	seed  uint64       // what its K/V's prefix hashes start from (prefixHashes): 0 without adapters
}

// adapter returns the adapter of w's request i.
func (w PrefixWorkload) adapter(i int) padapter {
	if w.Adapters <= 1 {
		return padapter{}
	}
	a := i % w.Adapters
	return padapter{index: a, ns: kv.Namespace{Adapter: fmt.Sprintf("lora-%d", a)},
		shift: int32(a) * Vocabulary, seed: mix64(uint64(a) + 1)}
}

// apart returns tokens as the paged baseline sees them under a: shifted into a range of
// token IDs of a's own, so that no two adapters share a prefix; tokens itself for
// adapter 0 and without adapters.
func (a padapter) apart(tokens []int32) []int32 {
	if a.shift == 0 {
		return tokens
	}
	out := make([]int32, len(tokens))
	for i, t := range tokens {
		out[i] = t + a.shift
	}
	return out
}

// prefixHashes returns the prefix hashes of tokens under a (prefixHashes).
func (a padapter) prefixHashes(tokens []int32) []uint64 { return prefixHashes(tokens, a.seed) }

// apart returns reqs with each request's hash ids made its adapter's own (request i
// of w's order, repeated past its end: another replica's replay), for the ideal
// cache; reqs itself without adapters.
func (w PrefixWorkload) apart(reqs []Request) []Request {
	if w.Adapters <= 1 {
		return reqs
	}
	out := make([]Request, len(reqs))
	for i, r := range reqs {
		a := int64(w.adapter(i % len(w.Requests)).index)
		blocks := make([]int64, len(r.Blocks))
		for b, h := range r.Blocks {
			blocks[b] = h*int64(w.Adapters) + a
		}
		r.Blocks = blocks
		out[i] = r
	}
	return out
}

// idealPerAdapter returns each adapter's IdealHits: an unbounded cache of its
// requests alone, each clipped to its length in lengths.
func (w PrefixWorkload) idealPerAdapter(lengths []int) []int64 {
	out := make([]int64, w.Adapters)
	for a := range w.Adapters {
		var reqs []Request
		var ls []int
		for i := a; i < len(w.Requests); i += w.Adapters {
			reqs, ls = append(reqs, w.Requests[i]), append(ls, lengths[i])
		}
		if len(reqs) > 0 {
			out[a] = IdealHits(reqs, ls)
		}
	}
	return out
}

// printAdapterTable writes each adapter's hit rate, and its ideal, per strategy.
func printAdapterTable(w io.Writer, rs []PrefixResult, adapters int) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprint(tw, "strategy\t")
	for a := range adapters {
		fmt.Fprintf(tw, "lora-%d\tideal\t", a)
	}
	fmt.Fprintln(tw)
	for _, r := range rs {
		if r.AdapterQueries == nil {
			continue
		}
		fmt.Fprintf(tw, "%s\t", r.Strategy)
		for a := range adapters {
			q := float64(r.AdapterQueries[a])
			if q == 0 {
				fmt.Fprint(tw, "-\t-\t")
				continue
			}
			fmt.Fprintf(tw, "%.2f%%\t%.2f%%\t", 100*float64(r.AdapterHits[a])/q, 100*float64(r.AdapterIdeal[a])/q)
		}
		fmt.Fprintln(tw)
	}
	tw.Flush()
	fmt.Fprintln(w, `
per adapter: hit rate of its requests' prompt tokens (request i under lora-(i mod N)); ideal:
           an unbounded cache of that adapter's own requests, no hit crossing adapters`)
	for _, r := range rs {
		if r.AdapterQueries != nil && r.Queries > 0 {
			fmt.Fprintf(w, "one unbounded cache shared by every adapter would find %.2f%% of the prompt tokens (%.2f%% apart): what keeping adapters apart costs on this trace, whose requests turn by turn land on other adapters\n",
				100*float64(r.SharedIdeal)/float64(r.Queries), 100*float64(r.IdealHits)/float64(r.Queries))
			break
		}
	}
}
