package kv

import (
	"fmt"
	"sync"
	"time"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/internal/poll"
	"github.com/vmarena/vmarena/internal/radix"
	"github.com/vmarena/vmarena/kv/blockhash"
)

// panicEventsOutOfStep is the panic value when the blocks a prefix cache announced no
// longer follow its index: a bug in the cache, never the caller's.
const panicEventsOutOfStep = "kv: prefix cache block events out of step with its index"

// The blocks a prefix cache announced, and how they follow its index.
//
// A block of the index is the run of tokens [i*B, (i+1)*B) of a path from the root,
// identified by those tokens and the block before it. It is announced (BlocksStored)
// when the index comes to hold all its tokens, and withdrawn (BlocksRemoved) when the
// index no longer does. The index gains tokens only by Insert, along the inserted
// path; it loses them only at the end of one leaf's path (a leaf shortened or removed
// by eviction, a damaged or taken-over entry, a pinned parent left childless), and
// the tokens it loses lie on that path alone, past its parent's depth. A leaf's path
// is always a prefix of the path its entry was inserted with. So after each change
// the events' side compares the blocks announced along that entry's inserted path
// with what the index now holds of it, announcing the blocks now whole and
// withdrawing those no longer so: a withdrawn block's descendants lie on the same
// path, since no other path shares its last token.

// A prefix cache's events keep its announced blocks: a tree of them under
// evSide.root, each found by its parent and its tokens, kept by the events' goroutine
// (run) from the changes the cache queues (next). NB: what apply computes depends
// only on the path, how much of it the index held at the change and the announced
// blocks, so applying the changes later, in order, tells the observer exactly what
// applying each at once would have.
//
// The cache queues no tokens. Each entry's inserted path has an id (pcEntry.evID),
// and the events' goroutine keeps a copy of it (paths) from the Insert until the
// entry leaves the index: Insert names the id, another entry whose path holds the
// tokens the index already held (base: the displaced leaf's, or any leaf's below the
// new leaf's parent) and the new leaf's edge, the index's own copy of the new tokens,
// which the goroutine copies from. The index holds a removed edge's array back from
// reuse (radix.Tree.DeferReuse) until every change queued before its removal is
// applied (the Release in inserted), so the goroutine never reads an array rewritten
// meanwhile. An eviction names the entry's id and how much of its path the index
// holds, and whether the entry left the index (its path is then dropped). So what a
// change costs the cache's call is one slot of the queue written under mu: no copy,
// no walk of the tokens, no allocation once the queue has grown, and no wake-up. (A
// copy of each path into a log, 32 KiB a request of 4,096 tokens, and a walk of the
// index after each eviction were what the calls' events still cost before.)
//
// Memory of the events' side: 4 bytes a token of each entry's inserted path, a path
// dropped once its entry leaves the index (evicted whole, displaced by a longer
// entry, damaged, taken over, Close): at most 4 × MaxTokens bytes an entry, entries
// that share a prefix each holding a copy of it; and, for a queued Insert, the
// index's edge array it names (a removed one held back from reuse until applied),
// plus the announced blocks' tree (one evBlock and one map key a block); on a model
// of window groups, per entry the first token each window group holds, and a count
// per block and window group that an entry holds there (events_groups.go).
//
// Locks: the queue has no lock of its own. The prefix cache's lock (pc.mu) guards
// it: a change is queued by a call that holds it already, so queueing takes no lock
// and no atomic at all; the events' goroutine takes pc.mu, holding nothing else, only
// to take the queue (a copy of at most evFirst slots and a swap of two slices) and to
// count what it applied, and calls the observer with no lock held. Close therefore
// queues the clear under pc.mu and waits for the goroutine after releasing it (wait).
//
// pcEvents is the queue, the part the cache's calls touch: a field of PrefixCache
// itself, next to the lock the call has just taken, with its first slots inline, so
// that queueing a change touches no memory of its own but the lines after the cache's
// lock (after a request's K/V writes the call finds everything out of the CPU caches:
// the fewer lines and pages, the fewer misses). The rest, evSide, is the goroutine's.
type pcEvents struct {
	lock    *sync.Mutex // the prefix cache's: it guards every field below
	side    *evSide     // nil without an observer: no events, at no cost
	taken   int64       // changes the goroutine took, in all (queued: count)
	applied int64       // changes applied, in all
	release int64       // count at the index's last Release
	started bool        // the goroutine runs: from the first change on
	closing bool
	// lim is how many of first next may fill inline: 0 before the first change
	// and from Close on, so that next tests one byte for all its rare cases.
	lim   uint8
	n     uint8             // changes in first
	first [evFirst]evChange // the oldest changes queued, then more
	more  []evChange        // what first can not hold
}

// evFirst is how many changes pcEvents holds inline: a request's calls queue about
// two (its Insert, an eviction) between two polls of the events' goroutine.
const evFirst = 4

var _ [1]struct{} = [evFirst&(evFirst-1) + 1]struct{}{} // evFirst is a power of 2 (next)

// evSide is the events' side of a prefix cache: its goroutine (run) and what it keeps.
type evSide struct {
	q     *pcEvents     // the cache's queue
	cond  *sync.Cond    // on q.lock: q.applied moved
	spare []evChange    // for q.more
	kick  chan struct{} // wakes the goroutine before its next poll
	done  chan struct{} // closed when it returns
	hold  func()        // nil but in tests: called at each poll, before the queue is taken

	// The events' goroutine's alone.
	taken  []evChange // the inline changes taken
	obs    BlockEvents
	hopts  blockhash.Options // EventOptions.Hash: the default namespace's
	bs     int
	medium string
	def    evSpace                // the default namespace's
	spaces map[Namespace]*evSpace // the others' that entries in the index are of
	blocks map[evKey]*evBlock
	paths  map[uint64]*evPath // by id: the inserted paths of the entries in the index
	key    []byte             // scratch: a block's tokens as the bytes of an evKey
	// The layer groups: full and MLA ones (told of the blocks of root's tree) and
	// window ones (told of the blocks their entries hold: see events_groups.go), and
	// the slot in wins of each group index (-1: not a window group).
	full, wins []evGroup
	winOf      []int
	held       map[evWinKey]int32 // per window group, the entries that hold each block
	chain      []*evBlock         // scratch: the announced blocks along a path
}

// evSpace is a namespace's part of the announced blocks: its root, the parent of its
// block 0s (so that no block of it is another namespace's, whatever their hashes),
// the hasher of its extra keys (Namespace) and the inserted paths of its entries in
// the index, counted: another namespace's is dropped with its last.
type evSpace struct {
	ns    Namespace
	root  evBlock
	h     *blockhash.Hasher
	lora  string
	paths int
}

// spaceOf returns the events' part of namespace ns (nil: the default), made when
// needed. Events' goroutine.
func (ev *evSide) spaceOf(ns *Namespace) *evSpace {
	if ns == nil {
		return &ev.def
	}
	if sp := ev.spaces[*ns]; sp != nil {
		return sp
	}
	o := ev.hopts
	if ns.Adapter != "" {
		o.LoRA = ns.Adapter
	}
	if ns.Salt != "" {
		o.CacheSalt = ns.Salt
	}
	h, err := blockhash.New(o)
	if err != nil {
		panic(err) // the default's options, made once already: never
	}
	sp := &evSpace{ns: *ns, h: h, lora: o.LoRA}
	sp.root.hash = h.Root()
	ev.spaces[*ns] = sp
	return sp
}

// dropPath forgets path id, whose entry left the index, and its namespace's part
// once no entry of it is left. Events' goroutine.
func (ev *evSide) dropPath(id uint64, p *evPath) {
	delete(ev.paths, id)
	sp := p.sp
	if sp.paths--; sp.paths == 0 && sp != &ev.def {
		if sp.root.kids != 0 {
			panic(panicEventsOutOfStep) // blocks announced that no entry holds
		}
		delete(ev.spaces, sp.ns)
	}
}

// evKind says what a queued change is.
type evKind uint8

const (
	evInsert evKind = iota // an entry inserted: its path is base[:m] then tail
	evCut                  // the index holds held tokens of path id now (gone: the entry left it)
	evDrop                 // path id's entry left the index, its tokens held by another
	evClear                // the end of the index (Close)
	evFrom                 // path id's entry holds window group base's tokens from n on
)

// evChange is a change of the index (see evKind): n is evInsert's m, evCut's held,
// evFrom's first token. tail is the index's own array; ns is evInsert's entry's
// namespace, nil for the default (the entry's own field, never written again).
type evChange struct {
	id, base uint64 // base 0: none
	tail     []int32
	ns       *Namespace
	n        int32
	kind     evKind
	gone     bool
}

// Polls of the events' goroutine: every evPoll while changes come, backing off to
// evIdlePolls intervals once quiet. A change never wakes it: waking a parked
// goroutine would cost the cache's call microseconds; queueing costs nanoseconds.
const (
	evPoll      = time.Millisecond
	evIdlePolls = 64
)

// evKey finds an announced block: its parent and its tokens (4 bytes each, little
// endian).
type evKey struct {
	parent *evBlock
	tokens string
}

// evBlock is an announced block.
type evBlock struct {
	hash blockhash.Hash
	kids int // announced blocks whose parent it is
}

// newEvents returns the events' side of a prefix cache over c, or nil when o has no
// observer; attach ties it to the cache's queue.
func newEvents(c *Cache, o EventOptions) (*evSide, error) {
	if o.Observer == nil {
		return nil, nil
	}
	h, err := blockhash.New(o.Hash)
	if err != nil {
		return nil, fmt.Errorf("%w: events: %w", ErrConfig, err)
	}
	if bs := h.BlockSize(); bs > c.cfg.MaxTokens {
		// NB: no sequence holds such a block whole, so none would ever be told; and
		// the block's key is made before the first.
		return nil, fmt.Errorf("%w: events: blocks of %d tokens, longer than MaxTokens %d", ErrConfig, bs, c.cfg.MaxTokens)
	}
	medium := o.Medium
	if medium == "" {
		medium = "CPU"
		if c.dev.Tier == accounting.Device {
			medium = "GPU"
		}
	}
	ev := &evSide{
		obs: o.Observer, hopts: o.Hash, bs: h.BlockSize(), medium: medium,
		def:    evSpace{h: h, lora: o.Hash.LoRA},
		spaces: make(map[Namespace]*evSpace),
		blocks: make(map[evKey]*evBlock), paths: make(map[uint64]*evPath),
		key: make([]byte, 4*h.BlockSize()), taken: make([]evChange, 0, evFirst),
		kick: make(chan struct{}, 1), done: make(chan struct{}),
		winOf: make([]int, len(c.groups)), held: make(map[evWinKey]int32),
	}
	ev.def.root.hash = h.Root()
	for gi := range c.groups {
		g := &c.groups[gi]
		ev.winOf[gi] = -1
		if g.state > 0 {
			continue // a recurrent state has no blocks: see prefixcache_checkpoint.go
		}
		if !g.windowed() {
			ev.full = append(ev.full, evGroup{idx: gi, kind: g.spec.Kind})
			continue
		}
		ev.winOf[gi] = len(ev.wins)
		ev.wins = append(ev.wins, evGroup{idx: gi, kind: g.spec.Kind, window: g.spec.Window})
	}
	return ev, nil
}

// attach makes q the queue of ev's changes (nil ev: no events), guarded by lock, the
// prefix cache's. Before q's first use.
func (q *pcEvents) attach(ev *evSide, lock *sync.Mutex) {
	q.lock = lock
	if ev == nil {
		return
	}
	q.side, ev.q = ev, q
	ev.cond = sync.NewCond(lock)
}

// next returns the slot of a new change, queued for the hook to write before it
// releases pc.mu (the goroutine takes the queue under it). pc.mu is held. It is
// inlined into the hooks: an inline slot, or one appended to more once those are
// taken. NB: while q.n < evFirst, more is empty (the goroutine takes both at once),
// so the slot is the newest.
func (q *pcEvents) next() *evChange {
	if n := q.n; n < q.lim {
		q.n = n + 1
		return &q.first[n&(evFirst-1)] // NB: the mask proves it in range (evFirst a power of 2)
	}
	if q.closing {
		panic(panicEventsOutOfStep) // the index changed after Close
	}
	q.more = append(q.more, evChange{})
	return &q.more[len(q.more)-1]
}

// count returns how many changes were queued, in all. pc.mu is held.
func (q *pcEvents) count() int64 { return q.taken + int64(q.n) + int64(len(q.more)) }

// run applies the queued changes in order, polling the queue, until it applies a
// clear.
func (ev *evSide) run() {
	defer close(ev.done)
	q := ev.q
	t := time.NewTimer(evPoll)
	defer t.Stop()
	backoff := poll.Backoff{Interval: evPoll, MaxPolls: evIdlePolls}
	for {
		select {
		case <-t.C:
		case <-ev.kick:
			t.Stop()
		}
		if ev.hold != nil {
			ev.hold()
		}
		q.lock.Lock()
		first := append(ev.taken[:0], q.first[:q.n]...) // the oldest, then more
		clear(q.first[:q.n])
		q.taken += int64(q.n) + int64(len(q.more))
		q.n = 0
		more := q.more
		q.more = ev.spare
		q.lock.Unlock()
		last := false
		for i := range first {
			last = ev.change(&first[i]) || last
		}
		for i := range more {
			last = ev.change(&more[i]) || last
		}
		applied := len(first) + len(more)
		clear(first) // the edges they name are the index's to reuse
		clear(more)
		ev.taken, ev.spare = first[:0], more[:0]
		if applied > 0 {
			q.lock.Lock()
			q.applied += int64(applied)
			ev.cond.Broadcast()
			q.lock.Unlock()
		}
		if last {
			return
		}
		t.Reset(backoff.Next(applied > 0))
	}
}

// change applies c and reports whether it was the clear, the last. Events'
// goroutine.
func (ev *evSide) change(c *evChange) bool {
	switch c.kind {
	case evClear:
		clear(ev.blocks)
		clear(ev.paths)
		clear(ev.held)
		clear(ev.spaces)
		ev.def.root.kids, ev.def.paths = 0, 0
		ev.obs.AllBlocksCleared()
		return true
	case evInsert:
		m := int(c.n)
		path := make([]int32, m+len(c.tail))
		if m > 0 {
			base := ev.paths[c.base]
			if base == nil || len(base.tokens) < m {
				panic(panicEventsOutOfStep)
			}
			copy(path, base.tokens[:m])
		}
		copy(path[m:], c.tail)
		p := &evPath{tokens: path, n: len(path), sp: ev.spaceOf(c.ns)}
		p.sp.paths++
		if len(ev.wins) > 0 {
			// Its window groups hold nothing until their evFrom.
			p.from = make([]int, len(ev.wins))
			for w := range p.from {
				p.from[w] = len(path)
			}
		}
		ev.paths[c.id] = p
		ev.apply(p.sp, path, len(path))
	case evCut:
		p, ok := ev.paths[c.id]
		if !ok || int(c.n) > len(p.tokens) {
			panic(panicEventsOutOfStep)
		}
		n := int(c.n)
		for w := range ev.wins {
			if c.gone {
				ev.holdWin(p, w, 0, 0)
			} else {
				ev.holdWin(p, w, p.from[w], n)
			}
		}
		p.n = n
		ev.apply(p.sp, p.tokens, n)
		if c.gone {
			ev.dropPath(c.id, p)
		}
	case evDrop:
		p, ok := ev.paths[c.id]
		if !ok {
			panic(panicEventsOutOfStep)
		}
		for w := range ev.wins {
			ev.holdWin(p, w, 0, 0)
		}
		ev.dropPath(c.id, p)
	case evFrom:
		p, ok := ev.paths[c.id]
		if !ok || c.base >= uint64(len(ev.winOf)) || ev.winOf[c.base] < 0 {
			panic(panicEventsOutOfStep)
		}
		w := ev.winOf[c.base]
		ev.holdWin(p, w, int(c.n), p.n)
	}
	return false
}

// flush returns once every change queued so far is applied. pc.mu must not be held.
func (q *pcEvents) flush() {
	if q.side == nil {
		return
	}
	q.lock.Lock()
	defer q.lock.Unlock()
	if !q.started {
		return
	}
	want := q.count()
	select {
	case q.side.kick <- struct{}{}:
	default:
	}
	for q.applied < want {
		q.side.cond.Wait()
	}
}

// FlushEvents returns once the prefix cache's observer has been told of every change
// made before the call (see BlockEvents); at once without an observer. A router in
// the same process calls it before it reads what the events told it.
func (pc *PrefixCache) FlushEvents() { pc.ev.flush() }

// inserted queues Insert's change: e, now in the index at e.leaf, whose first m
// tokens the index held before (displacing old, when displaced). It also frees for
// reuse the index's edge arrays that no queued change names any more (see pcEvents).
// pc.mu is held.
func (q *pcEvents) inserted(t *radix.Tree[*pcEntry], e *pcEntry, m int, old *pcEntry, displaced bool) {
	if q.side == nil {
		return
	}
	leaf := e.leaf
	c := evChange{kind: evInsert, n: int32(m)}
	switch {
	case displaced:
		c.base = old.evID // its leaf ended at depth m
	case m > 0:
		// Any other leaf below the new leaf's parent, which ends at depth m.
		other := leaf.Parent().AnyLeaf(leaf)
		if other == nil {
			panic(panicEventsOutOfStep)
		}
		c.base = other.Value().evID
	}
	edge := leaf.Edge()
	c.tail = edge[len(edge)-(leaf.Depth()-m):]
	if !q.started {
		// The index's first change is always an Insert: the goroutine runs from it.
		q.started, q.lim = true, evFirst
		go q.side.run()
	}
	e.evID = uint64(q.count() + 1) // the change's number, which no other has: the path's id
	c.id = e.evID
	if e.ns != (Namespace{}) {
		c.ns = &e.ns
	}
	*q.next() = c
	if q.applied >= q.release {
		// Every change queued before the last Release is applied: the arrays
		// removed before it are read by none.
		t.Release()
		q.release = q.count()
	}
}

// cut queues an eviction's change of e's path, of which the index now holds the
// first held tokens; gone says that e left the index. pc.mu is held.
func (q *pcEvents) cut(e *pcEntry, held int, gone bool) {
	if q.side != nil {
		*q.next() = evChange{kind: evCut, id: e.evID, n: int32(held), gone: gone}
	}
}

// from queues that e holds its path's tokens in window group gi from first on (its
// insert's, or eviction's of older window units). pc.mu is held.
func (q *pcEvents) from(e *pcEntry, gi, first int) {
	if q.side != nil {
		*q.next() = evChange{kind: evFrom, id: e.evID, base: uint64(gi), n: int32(first)}
	}
}

// displaced queues the end of e's path, whose tokens the index still holds (a longer
// entry displaced it). pc.mu is held.
func (q *pcEvents) displaced(e *pcEntry) {
	if q.side != nil {
		*q.next() = evChange{kind: evDrop, id: e.evID}
	}
}

// apply applies a change along path, of namespace sp, of which the index held the
// first held tokens (see sync).
func (ev *evSide) apply(sp *evSpace, path []int32, held int) {
	full, n := held/ev.bs, len(path)/ev.bs
	cur, i := &sp.root, 0
	for ; i < n; i++ {
		ev.fill(path, i)
		b := ev.blocks[evKey{cur, string(ev.key)}]
		if b == nil {
			break
		}
		if i >= full {
			ev.withdraw(cur, path, i)
			return
		}
		cur = b
	}
	if i < full {
		ev.announce(sp, cur, path, i, full)
	}
}

// announce announces blocks [from, to) of path, of namespace sp, the block before
// them being parent. NB: path is the events' side's, dropped with its entry: the
// observer gets a copy.
func (ev *evSide) announce(sp *evSpace, parent *evBlock, path []int32, from, to int) {
	bs := ev.bs
	st := BlocksStored{
		Hashes: make([]uint64, 0, to-from), HasParent: parent != &sp.root,
		Tokens: path[from*bs : to*bs], BlockSize: bs, LoRA: sp.lora, Medium: ev.medium,
	}
	if st.HasParent {
		st.Parent = parent.hash.Uint64()
	}
	hash := parent.hash
	for i := from; i < to; i++ {
		extra := sp.h.ExtraKeys(i)
		hash = sp.h.Block(hash, path[i*bs:(i+1)*bs], extra)
		if extra != nil && st.ExtraKeys == nil {
			st.ExtraKeys = make([][]any, i-from, to-from)
		}
		if st.ExtraKeys != nil {
			st.ExtraKeys = append(st.ExtraKeys, extra)
		}
		b := &evBlock{hash: hash}
		ev.fill(path, i)
		ev.blocks[evKey{parent, string(ev.key)}] = b
		parent.kids++
		parent = b
		st.Hashes = append(st.Hashes, hash.Uint64())
	}
	ev.tellStored(st)
}

// withdraw withdraws block i of path, whose parent is parent, and the announced
// blocks past it on path: its only descendants, or the events are out of step.
func (ev *evSide) withdraw(parent *evBlock, path []int32, i int) {
	rm := BlocksRemoved{Medium: ev.medium}
	first := parent
	for ; i < len(path)/ev.bs; i++ {
		ev.fill(path, i)
		k := evKey{parent, string(ev.key)}
		b := ev.blocks[k]
		if b == nil {
			break
		}
		ev.unheld(b)
		delete(ev.blocks, k)
		parent.kids--
		if parent != first && parent.kids != 0 {
			panic(panicEventsOutOfStep)
		}
		rm.Hashes = append(rm.Hashes, b.hash.Uint64())
		parent = b
	}
	if parent != first && parent.kids != 0 {
		panic(panicEventsOutOfStep)
	}
	ev.tellRemoved(rm)
}

// clear queues the end of every announced block, told once the changes before it are
// (Close; wait waits for it): with nothing queued ever, it tells the observer at
// once. pc.mu is held.
func (q *pcEvents) clear() {
	ev := q.side
	if ev == nil {
		return
	}
	if !q.started {
		q.closing = true
		ev.obs.AllBlocksCleared() // nothing was announced, nor queued
		return
	}
	*q.next() = evChange{kind: evClear}
	q.closing, q.lim = true, 0
	select {
	case ev.kick <- struct{}{}:
	default:
	}
}

// wait returns once the observer has been told of the clear, and the events'
// goroutine is gone. After clear, with pc.mu released: the goroutine takes it to
// take the clear.
func (q *pcEvents) wait() {
	if q.side != nil && q.started {
		<-q.side.done
	}
}
