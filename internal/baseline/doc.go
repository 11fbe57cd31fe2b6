// Package baseline holds the KV-cache strategies a Go server author would write without
// vmarena, each a real implementation that allocates and touches the memory it
// reports, so that the kv package's benchmarks and the kvcache example can drive them
// and the kv cache through one interface ([Strategy]) and compare them honestly.
//
//   - [Eager] preallocates MaxTokens for every (layer, K|V) tensor of a sequence and
//     clears it, as servers that reserve num_ctx per parallel slot do (ollama,
//     llama.cpp). Closed sequences leave their slot resident for the next one. It never
//     allocates on the token path: the floor for time per token.
//   - [Paged] keeps a pool of fixed blocks of 16 tokens (all layers, K and V), grown in
//     chunks and never shrunk, and a block table per sequence: the vLLM design. A
//     shared prefix is shared by block reference counts; its partly filled last block
//     is copied into each sequence (copy on write). With per-layer sliding windows
//     (PagedOptions.Windows) it is vLLM's hybrid KV cache manager: the layers of each
//     window form groups with blocks and block tables of their own, and a window
//     group gives its blocks back to the pool once every token in them is behind the
//     window (kv's rule, kv.Group.FirstLive), so a model such as gpt-oss-20b, half of
//     its layers a 128-token window, has a paged baseline that holds what vLLM holds;
//     a token given back reads and writes as ErrDropped.
//   - [Append] grows one Go slice per tensor with append: the naive way.
//
// Eager and Append share a prefix by copying it into each sequence (ollama's
// CopyPrefix): the prefix's bytes are held once by the [Prefix] and once more by every
// sequence started from it.
//
// # Memory management
//
// Every strategy counts the bytes it holds in Go slices (their capacity) as Physical,
// and, when given an [accounting.Authority], charges them there before allocating, so
// a governor budget bounds it as it bounds the kv cache: a refusal is an error
// matching [accounting.ErrBudgetExceeded] and changes nothing. Slices are cleared when
// allocated so that their pages are resident, as a server's buffers are.
//
// NB: Physical is what the strategy holds; a Go heap also holds garbage not yet
// collected (Append's outgrown slices), so the process may hold more.
//
// A [Sequence] MUST be closed and a [Prefix] released; [Strategy.Close] gives back
// everything and refuses (ErrBusy) while sequences or prefixes are live.
//
// # Concurrency
//
// A Strategy is safe for concurrent use: several goroutines may create, grow and
// close sequences at once. A Sequence is used by one goroutine at a time.
package baseline
