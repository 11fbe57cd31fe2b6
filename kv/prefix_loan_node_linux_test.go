package kv_test

import (
	"bufio"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/arena"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/backing/nodepool"
	"github.com/vmarena/vmarena/internal/testutil"
	"github.com/vmarena/vmarena/kv"
)

// Prefixes across processes (Prefix.Lend, Cache.BorrowPrefix) on a node pool: the
// test process is the pool's owner and process A, which freezes a prefix; a helper
// process B (this test binary run again, TestPrefixLoanHelper) borrows it and starts
// sequences on it. NB: the caches are made with kv.New on nodepool clients, not with
// openEnv: the env builds the backings of one process and has none for a node pool,
// whose two halves live in two processes here.

// loanCases are the models and layouts lent across processes: a uniform model and
// a hybrid one with window groups (whose prefix ranges start past their dropped
// tokens), each in both layouts.
var loanCases = []struct {
	name   string
	model  kv.Model
	layout kv.Layout
}{
	{"tiny8/Blocked", tiny8, kv.Blocked},
	{"tiny8/PerLayer", tiny8, kv.PerLayer},
	{"hybrid/Blocked", loanHybrid, kv.Blocked},
	{"hybrid/PerLayer", loanHybrid, kv.PerLayer},
}

// loanHybrid is hostHybrid without its recurrent layer, which no prefix can hold.
var loanHybrid = withoutRecurrent(hostHybrid, "loan-hybrid")

const (
	loanTokens    = 30 // the prefix: whole blocks (granules) and a tail in every case
	loanOwn       = 9  // tokens each of B's sequences appends
	loanMaxTokens = 256
	// loanHelperEnv holds the owner's socket path in a helper process; loanCaseEnv
	// the index of its case in loanCases.
	loanHelperEnv = "KV_TEST_LOAN_SOCKET"
	loanCaseEnv   = "KV_TEST_LOAN_CASE"
)

func loanConfig(i int) kv.Config {
	// NB: no map-ahead (on by default on a pooling backing), so that what a cache
	// owns is exactly what its sequences commit.
	return kv.Config{Model: loanCases[i].model, Layout: loanCases[i].layout, MaxTokens: loanMaxTokens, NoMapAhead: true}
}

// TestPrefixLoanAcrossProcesses: a prefix frozen in process A and lent to process
// B is mapped there with no copy. B's borrow commits nothing and its two sequences
// commit only the tails a local start commits; A's ledger on the node counts the
// prefix's granules once; B reads every prefix token bit-exact, can not write the
// borrowed ones (WriteToken is refused, a store faults), writes its own; A lets its
// prefix go while B maps it and B's bytes stay; a cache of another model refuses
// the loan, a second borrow of it is refused; and every ledger is back to zero at
// the end.
func TestPrefixLoanAcrossProcesses(t *testing.T) {
	for i, tc := range loanCases {
		t.Run(tc.name, func(t *testing.T) { runPrefixLoan(t, i) })
	}
}

func runPrefixLoan(t *testing.T, ci int) {
	path := filepath.Join(t.TempDir(), "node.sock")
	o, err := nodepool.Listen(path, nodepool.OwnerOptions{Granularity: envGranule})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, o.Close()) })
	a, err := nodepool.Attach(path, nodepool.ClientOptions{High: nodepool.ClientNoPool})
	require.NoError(t, err)
	t.Cleanup(func() { _ = a.Close() })
	c, err := kv.New(a, loanConfig(ci))
	require.NoError(t, err)

	s, err := c.NewSequence()
	require.NoError(t, err)
	require.NoError(t, s.Append(loanTokens))
	require.NoError(t, writeHeld(s, 1, 0, loanTokens))
	p, err := s.Freeze(loanTokens)
	require.NoError(t, err)
	// What a local start on p commits of its own: its tail.
	local, err := c.NewSequenceFrom(p)
	require.NoError(t, err)
	ls := seqStats(c, local)
	require.Positive(t, ls.Shared, "the prefix has whole granules to map")
	require.Equal(t, accounting.Complete, local.Close().Status)
	ownedA := a.Accounting().Authority().Stats().Owned

	h := startLoanHelper(t, path, ci)
	loan, err := p.Lend(h.number)
	require.NoError(t, err)
	assert.Equal(t, loanTokens, loan.Len())
	assert.Equal(t, p.Committed(), int64(loan.Granules()*envGranule), "every granule of the prefix is lent, its tail's too")
	data, err := loan.MarshalBinary()
	require.NoError(t, err)
	var back kv.PrefixLoan
	require.NoError(t, back.UnmarshalBinary(data))
	require.Equal(t, loan, back)

	h.say(t, "loan "+hex.EncodeToString(data))
	f := h.fields(t, "borrowed")
	t.Logf("A: prefix of %d tokens, %d granules lent (%d bytes), a local start commits %d bytes of its own and maps %d; B: %v",
		loanTokens, loan.Granules(), p.Committed(), ls.Committed-ls.Shared, ls.Shared, f)
	assert.Equal(t, "0", f["owned"], "the borrow commits nothing")
	assert.Equal(t, strconv.FormatInt(p.Committed(), 10), f["mapped"], "the borrow maps the prefix's granules")
	assert.Equal(t, strconv.FormatInt(2*(ls.Committed-ls.Shared), 10), f["owned2"], "two sequences commit only their tails, as a local start does")
	assert.Equal(t, strconv.FormatInt(2*ls.Shared, 10), f["shared2"], "two sequences map the whole granules, as a local start does")
	assert.Equal(t, f["sum"], f["ownedEnd"], "B's ledger owns exactly what its sequences commit of their own")
	for _, k := range []string{"intact", "readonly", "mismatch", "again"} {
		assert.Equal(t, "true", f[k], k)
	}

	// The node counts the prefix's granules once, at A.
	ownedB, err := strconv.ParseInt(f["ownedEnd"], 10, 64)
	require.NoError(t, err)
	st := o.Stats()
	ca, cb := clientStats(t, st, a.Number()), clientStats(t, st, h.number)
	assert.Equal(t, ownedA, ca.Owned, "A is charged for the lent granules once")
	assert.Equal(t, ownedB, cb.Owned)
	assert.Equal(t, loan.Granules(), cb.Borrowed)
	assert.Equal(t, ownedA+ownedB, st.Device.Used)

	// A lets go of the prefix and the sequence it came from while B maps them.
	require.Equal(t, accounting.Complete, s.Close().Status)
	p.Release()
	_, err = a.Usage() // the frees went before it on the socket: the owner has them
	require.NoError(t, err)
	assert.Zero(t, a.Accounting().Authority().Stats().Owned, "A maps nothing")
	assert.Equal(t, int64(loan.Granules()*envGranule), clientStats(t, o.Stats(), a.Number()).Owned,
		"the granules B still borrows stay charged to A")
	h.say(t, "check")
	assert.Equal(t, "true", h.fields(t, "checked")["intact"], "B's bytes after A let go")

	h.say(t, "done")
	f = h.fields(t, "closed")
	assert.Equal(t, "0", f["owned"])
	assert.Equal(t, "0", f["mapped"])
	require.NoError(t, h.cmd.Wait())
	require.NoError(t, c.Close())
	st = o.Stats()
	assert.Zero(t, st.Device.Used, "the node's ledger")
	assert.Zero(t, st.Granules, "no granule lives")
	assert.Zero(t, clientStats(t, st, a.Number()).Owned)
	as := a.Accounting().Authority().Stats()
	assert.Zero(t, as.Owned)
	assert.Zero(t, as.Mapped)
}

// seqStats returns the stats of s among c's.
func seqStats(c *kv.Cache, s *kv.Sequence) kv.SequenceStats {
	for _, st := range c.SequenceStats() {
		if st.ID == s.ID() {
			return st
		}
	}
	return kv.SequenceStats{}
}

// clientStats returns the owner's stats of client number n.
func clientStats(t *testing.T, st nodepool.NodeStats, n uint64) nodepool.ClientStats {
	t.Helper()
	for _, c := range st.Clients {
		if c.Number == n {
			return c
		}
	}
	t.Fatalf("no client %d on the node", n)
	return nodepool.ClientStats{}
}

// writeHeld writes tokens [from, to) of every tensor of s that s still holds (a
// window group's from its FirstHeld on) as writer w.
func writeHeld(s *kv.Sequence, w uint64, from, to int) error {
	return eachHeld(s, from, to, func(layer int, kind kv.Kind, tok int, buf []byte) error {
		testutil.FillToken(buf, w, layer, kind, tok)
		return s.WriteToken(layer, kind, tok, buf)
	})
}

// checkHeld checks that the tokens [from, to) s holds read as writer w wrote them.
func checkHeld(s *kv.Sequence, w uint64, from, to int) error {
	return eachHeld(s, from, to, func(layer int, kind kv.Kind, tok int, buf []byte) error {
		if err := s.ReadToken(layer, kind, tok, buf); err != nil {
			return err
		}
		if i := testutil.TokenAt(buf, w, layer, kind, tok); i >= 0 {
			return fmt.Errorf("%w: layer %d %v token %d byte %d (writer %d)", errCorrupt, layer, kind, tok, i, w)
		}
		return nil
	})
}

// loanHelper is a running helper process B.
type loanHelper struct {
	cmd    *exec.Cmd
	in     io.WriteCloser
	out    *bufio.Reader
	number uint64
}

// startLoanHelper starts this test binary as process B of case ci on the owner at
// path and reads its client number.
func startLoanHelper(t *testing.T, path string, ci int) *loanHelper {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestPrefixLoanHelper$")
	cmd.Env = append(os.Environ(), loanHelperEnv+"="+path, loanCaseEnv+"="+strconv.Itoa(ci))
	in, err := cmd.StdinPipe()
	require.NoError(t, err)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	h := &loanHelper{cmd: cmd, in: in, out: bufio.NewReader(out)}
	h.number, err = strconv.ParseUint(h.fields(t, "ready")["number"], 10, 64)
	require.NoError(t, err)
	return h
}

func (h *loanHelper) say(t *testing.T, line string) {
	t.Helper()
	_, err := io.WriteString(h.in, line+"\n")
	require.NoError(t, err)
}

// fields reads the helper's next line, which must start with word, and returns its
// key=value fields.
func (h *loanHelper) fields(t *testing.T, word string) map[string]string {
	t.Helper()
	line, err := h.out.ReadString('\n')
	require.NoError(t, err, "the helper says %s", word)
	f := strings.Fields(line)
	require.NotEmpty(t, f)
	require.Equal(t, word, f[0], "the helper says %q", line)
	m := make(map[string]string, len(f)-1)
	for _, kv := range f[1:] {
		k, v, ok := strings.Cut(kv, "=")
		require.True(t, ok, "the helper says %q", line)
		m[k] = v
	}
	return m
}

// TestPrefixLoanHelper is process B of TestPrefixLoanAcrossProcesses: it runs only
// in the helper process that test starts.
func TestPrefixLoanHelper(t *testing.T) {
	path := os.Getenv(loanHelperEnv)
	if path == "" {
		t.Skip("the helper process of TestPrefixLoanAcrossProcesses")
	}
	ci, err := strconv.Atoi(os.Getenv(loanCaseEnv))
	if err != nil {
		t.Fatal(err)
	}
	// NB: it exits here, so that the goroutine leak check of TestMain does not run on
	// what a failure left.
	os.Exit(runLoanHelper(path, ci))
}

// runLoanHelper is process B: it says "ready number=N"; on "loan <hex>" it
// borrows the prefix, starts two sequences on it and says what it saw
// ("borrowed ..."); on "check" it reads them again ("checked intact=..."); on
// "done" it closes everything and says what its ledger holds ("closed ...").
func runLoanHelper(path string, ci int) int {
	fail := func(what string, err error) int {
		fmt.Fprintf(os.Stderr, "loan helper: %s: %v\n", what, err)
		return 1
	}
	cl, err := nodepool.Attach(path, nodepool.ClientOptions{High: nodepool.ClientNoPool})
	if err != nil {
		return fail("attach", err)
	}
	auth := cl.Accounting().Authority()
	cache, err := kv.New(cl, loanConfig(ci))
	if err != nil {
		return fail("kv.New", err)
	}
	other, err := kv.New(cl, kv.Config{Model: kv.Uniform("other", 3, 4, 64, arena.Float16), Layout: loanCases[ci].layout, MaxTokens: loanMaxTokens, NoMapAhead: true})
	if err != nil {
		return fail("kv.New of another model", err)
	}
	fmt.Printf("ready number=%d\n", cl.Number())
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(nil, 1<<20)
	next := func(word string) (string, bool) {
		if !in.Scan() {
			return "", false
		}
		rest, ok := strings.CutPrefix(in.Text(), word)
		return strings.TrimSpace(rest), ok
	}
	arg, ok := next("loan")
	if !ok {
		return fail("read the loan", in.Err())
	}
	data, err := hex.DecodeString(arg)
	if err != nil {
		return fail("decode the loan", err)
	}
	var loan kv.PrefixLoan
	if err := loan.UnmarshalBinary(data); err != nil {
		return fail("unmarshal the loan", err)
	}
	_, err = other.BorrowPrefix(loan)
	mismatch := errors.Is(err, kv.ErrLoan)
	p, err := cache.BorrowPrefix(loan)
	if err != nil {
		return fail("borrow", err)
	}
	as := auth.Stats()
	owned, mapped := as.Owned, as.Mapped
	_, err = cache.BorrowPrefix(loan)
	again := errors.Is(err, kv.ErrLoan)
	var seqs [2]*kv.Sequence
	var owned2, shared2 int64
	for i := range seqs {
		if seqs[i], err = cache.NewSequenceFrom(p); err != nil {
			return fail("start a sequence on the borrowed prefix", err)
		}
		shared2 += seqStats(cache, seqs[i]).Shared
	}
	owned2 = auth.Stats().Owned
	intact := true
	readOnly := true
	for i, s := range seqs {
		if err := checkHeld(s, 1, 0, loanTokens); err != nil {
			fmt.Fprintln(os.Stderr, "loan helper: a prefix token:", err)
			intact = false
		}
		// A write to a borrowed token is refused. NB: below Writable, a group that
		// maps fewer whole units than another holds its own copy of some tokens,
		// which take the write; they get the prefix's bytes back.
		w := s.Writable()
		refused := 0
		err := eachHeld(s, 0, w, func(layer int, kind kv.Kind, tok int, buf []byte) error {
			testutil.FillToken(buf, 9, layer, kind, tok)
			err := s.WriteToken(layer, kind, tok, buf)
			if errors.Is(err, kv.ErrReadOnly) {
				refused++
				return nil
			} else if err != nil {
				return err
			}
			testutil.FillToken(buf, 1, layer, kind, tok)
			return s.WriteToken(layer, kind, tok, buf)
		})
		if err != nil {
			fmt.Fprintln(os.Stderr, "loan helper: a write below Writable:", err)
		}
		readOnly = readOnly && err == nil && refused > 0
		// And the memory itself: a store into the first token of a layer that holds
		// it faults, a load does not.
		for l := range s.Cache().Config().Model.Layers {
			if s.FirstHeld(l) == 0 {
				at := s.Base(l, kv.K)
				readOnly = readOnly && testutil.Touch(at, true) != nil && testutil.Touch(at, false) == nil
				break
			}
		}
		if err := s.Append(loanOwn); err != nil {
			return fail("append", err)
		}
		if err := writeHeld(s, uint64(2+i), w, s.Len()); err != nil {
			return fail("write own tokens", err)
		}
	}
	check := func() bool {
		for i, s := range seqs {
			w := s.Writable()
			if err := errors.Join(checkHeld(s, 1, 0, w), checkHeld(s, uint64(2+i), w, s.Len())); err != nil {
				fmt.Fprintf(os.Stderr, "loan helper: sequence %d: %v\n", i, err)
				return false
			}
		}
		return true
	}
	intact = intact && check()
	var sum int64
	for _, st := range cache.SequenceStats() {
		sum += st.Committed - st.Shared
	}
	fmt.Printf("borrowed owned=%d mapped=%d owned2=%d shared2=%d ownedEnd=%d sum=%d intact=%v readonly=%v mismatch=%v again=%v\n",
		owned, mapped, owned2, shared2, auth.Stats().Owned, sum, intact, readOnly, mismatch, again)
	if _, ok := next("check"); !ok {
		return fail("read check", in.Err())
	}
	fmt.Printf("checked intact=%v\n", check())
	if _, ok := next("done"); !ok {
		return fail("read done", in.Err())
	}
	for _, s := range seqs {
		if out := s.Close(); out.Status != accounting.Complete {
			return fail("close a sequence", out.Err)
		}
	}
	p.Release()
	if err := errors.Join(cache.Close(), other.Close()); err != nil {
		return fail("close the caches", err)
	}
	// The frees went before this request on the socket: the owner has them.
	if _, err := cl.Usage(); err != nil {
		return fail("usage", err)
	}
	as = auth.Stats()
	fmt.Printf("closed owned=%d mapped=%d\n", as.Owned, as.Mapped)
	if err := cl.Close(); err != nil {
		return fail("close", err)
	}
	return 0
}

// nodePair is an owner and two clients of it in this process, each with a cache of
// cfg: what the in-process loan tests and the benchmark lend between (the owner
// tells processes apart by their connections, so two clients of one process are two
// processes to it).
type nodePair struct {
	o      *nodepool.Owner
	cl     [2]*nodepool.Client
	caches [2]*kv.Cache
}

func newNodePair(t testing.TB, cfg kv.Config) *nodePair {
	t.Helper()
	np := &nodePair{}
	path := filepath.Join(t.TempDir(), "node.sock")
	var err error
	np.o, err = nodepool.Listen(path, nodepool.OwnerOptions{Granularity: envGranule})
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, np.o.Close()) })
	for i := range np.cl {
		np.cl[i], err = nodepool.Attach(path, nodepool.ClientOptions{High: nodepool.ClientNoPool})
		require.NoError(t, err)
		t.Cleanup(func() { _ = np.cl[i].Close() })
		np.caches[i], err = kv.New(np.cl[i], cfg)
		require.NoError(t, err)
	}
	return np
}

// frozen returns a prefix of n tokens of cache 0 written as writer 1, and the
// sequence it was frozen from.
func (np *nodePair) frozen(t testing.TB, n int) (*kv.Sequence, *kv.Prefix) {
	t.Helper()
	s, err := np.caches[0].NewSequence()
	require.NoError(t, err)
	require.NoError(t, s.Append(n))
	require.NoError(t, writeHeld(s, 1, 0, n))
	p, err := s.Freeze(n)
	require.NoError(t, err)
	return s, p
}

// TestPrefixLoanRefused: a loan lent to another process, one whose fingerprint or
// token count was changed, and a second borrow of one are refused with ErrLoan
// before the node pool is asked, mapping nothing, and the right loan borrows after
// them; a borrowed prefix can not be lent onward.
func TestPrefixLoanRefused(t *testing.T) {
	np := newNodePair(t, loanConfig(0))
	s, p := np.frozen(t, loanTokens)
	b := np.caches[1]
	bAuth := np.cl[1].Accounting().Authority()

	wrong, err := p.Lend(np.cl[0].Number())
	require.NoError(t, err)
	loan, err := p.Lend(np.cl[1].Number())
	require.NoError(t, err)
	data, err := loan.MarshalBinary()
	require.NoError(t, err)
	tampered := func(at int, v byte) kv.PrefixLoan {
		d := append([]byte(nil), data...)
		d[at] = v
		var l kv.PrefixLoan
		require.NoError(t, l.UnmarshalBinary(d))
		return l
	}
	const at = len("vmkvloan\x01") // the fingerprint, then the borrower and the tokens
	for _, tt := range []struct {
		name string
		loan kv.PrefixLoan
	}{
		{"lent to another process", wrong},
		{"another fingerprint", tampered(at, data[at]^1)},
		{"another token count", tampered(at+9, 100)},
		{"nothing", kv.PrefixLoan{}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := b.BorrowPrefix(tt.loan)
			require.ErrorIs(t, err, kv.ErrLoan)
			assert.Zero(t, bAuth.Stats().Mapped, "nothing mapped")
			assert.Zero(t, b.Stats().Prefixes)
		})
	}

	bp, err := b.BorrowPrefix(loan)
	require.NoError(t, err, "the right loan, after the refused ones")
	_, err = b.BorrowPrefix(loan)
	require.ErrorIs(t, err, kv.ErrLoan, "a second borrow")
	_, err = bp.Lend(np.cl[0].Number())
	require.ErrorIs(t, err, backing.ErrReadOnly, "a borrowed prefix is lent by its lender only")
	seq, err := b.NewSequenceFrom(bp)
	require.NoError(t, err)
	require.NoError(t, checkHeld(seq, 1, 0, loanTokens))
	bp.Release()
	require.Equal(t, accounting.Complete, seq.Close().Status)

	// Once every mapping of the loan went, the loan borrows again while its lender
	// keeps the prefix.
	bp, err = b.BorrowPrefix(loan)
	require.NoError(t, err)
	bp.Release()
	p.Release()
	require.Equal(t, accounting.Complete, s.Close().Status)
	for i, c := range np.caches {
		require.NoError(t, c.Close())
		_, err := np.cl[i].Usage()
		require.NoError(t, err)
		as := np.cl[i].Accounting().Authority().Stats()
		assert.Zero(t, as.Owned)
		assert.Zero(t, as.Mapped)
	}
	assert.Zero(t, np.o.Stats().Device.Used)
}

// BenchmarkPrefixLoanStart is the time to start a sequence on a prefix (and close
// it): from=local on the prefix its cache froze, from=borrowed on the same prefix
// borrowed by another client of the node; borrow is BorrowPrefix and Release of
// that prefix (the owner's round trip and the mappings). tiny8, Blocked, 4 KiB
// granules, a prefix of 256 tokens: 64 blocks of 3 granules, and a copied tail of
// one block at 254 tokens.
func BenchmarkPrefixLoanStart(b *testing.B) {
	for _, n := range []int{256, 254} {
		np := newNodePair(b, kv.Config{Model: tiny8, MaxTokens: 1024})
		s, p := np.frozen(b, n)
		loan, err := p.Lend(np.cl[1].Number())
		require.NoError(b, err)
		bp, err := np.caches[1].BorrowPrefix(loan)
		require.NoError(b, err)
		start := func(b *testing.B, c *kv.Cache, p *kv.Prefix) {
			for b.Loop() {
				s, err := c.NewSequenceFrom(p)
				if err != nil {
					b.Fatal(err)
				}
				s.Close()
			}
		}
		b.Run(fmt.Sprintf("tokens=%d/from=local", n), func(b *testing.B) { start(b, np.caches[0], p) })
		b.Run(fmt.Sprintf("tokens=%d/from=borrowed", n), func(b *testing.B) { start(b, np.caches[1], bp) })
		bp.Release()
		b.Run(fmt.Sprintf("tokens=%d/borrow", n), func(b *testing.B) {
			for b.Loop() {
				bp, err := np.caches[1].BorrowPrefix(loan)
				if err != nil {
					b.Fatal(err)
				}
				bp.Release()
			}
		})
		p.Release()
		s.Close()
		for _, c := range np.caches {
			require.NoError(b, c.Close())
		}
	}
}

// TestPrefixLoanFromPrefixCache: a prefix-cache entry is lent by freezing the
// sequence a Lookup returned on it; the borrower reads the entry's tokens, and the
// lender's prefix cache evicts the entry while the borrower maps it.
func TestPrefixLoanFromPrefixCache(t *testing.T) {
	np := newNodePair(t, loanConfig(0))
	pc, err := kv.NewPrefixCache(np.caches[0], kv.PrefixCacheOptions{})
	require.NoError(t, err)
	ids := make([]int32, 64)
	for i := range ids {
		ids[i] = int32(1000 + i)
	}
	s, err := np.caches[0].NewSequence()
	require.NoError(t, err)
	require.NoError(t, s.Append(len(ids)))
	require.NoError(t, writeHeld(s, 1, 0, len(ids)))
	require.NoError(t, pc.Insert(s, ids))
	require.Equal(t, accounting.Complete, s.Close().Status)

	hit, n, err := pc.Lookup(ids)
	require.NoError(t, err)
	require.Positive(t, n)
	p, err := hit.Freeze(n)
	require.NoError(t, err)
	require.Equal(t, accounting.Complete, hit.Close().Status)
	loan, err := p.Lend(np.cl[1].Number())
	require.NoError(t, err)
	bp, err := np.caches[1].BorrowPrefix(loan)
	require.NoError(t, err)
	p.Release()
	require.NoError(t, pc.Close(), "evicts the entry")

	seq, err := np.caches[1].NewSequenceFrom(bp)
	require.NoError(t, err)
	require.NoError(t, checkHeld(seq, 1, 0, n), "the entry's tokens, after its eviction")
	require.Equal(t, accounting.Complete, seq.Close().Status)
	bp.Release()
	for i, c := range np.caches {
		require.NoError(t, c.Close())
		_, err := np.cl[i].Usage()
		require.NoError(t, err)
		assert.Zero(t, np.cl[i].Accounting().Authority().Stats().Owned)
	}
	assert.Zero(t, np.o.Stats().Device.Used)
}

// TestPrefixLoanBorrowRace: two borrows of one loan at once in one cache: one maps
// it, the other is refused with ErrLoan before the node pool is asked, and the
// client's connection stays up.
func TestPrefixLoanBorrowRace(t *testing.T) {
	np := newNodePair(t, loanConfig(0))
	s, p := np.frozen(t, loanTokens)
	loan, err := p.Lend(np.cl[1].Number())
	require.NoError(t, err)
	var got [2]*kv.Prefix
	var errs [2]error
	wait := goWorkers(2, func(w int) error {
		got[w], errs[w] = np.caches[1].BorrowPrefix(loan)
		return nil
	})
	wait(t)
	won := 0
	for w := range got {
		if errs[w] == nil {
			won++
			got[w].Release()
		} else {
			assert.ErrorIs(t, errs[w], kv.ErrLoan)
		}
	}
	assert.Equal(t, 1, won)
	_, err = np.cl[1].Usage()
	require.NoError(t, err, "the borrower's connection")
	p.Release()
	require.Equal(t, accounting.Complete, s.Close().Status)
	for _, c := range np.caches {
		require.NoError(t, c.Close())
	}
}
