package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/vmarena/vmarena/kvtier/filetier"
)

// tierFile is the tier -tiers file names: kvtier/filetier in -file-tier's directory.
const tierFile = "file"

// The hidden flag that makes the program the second process of -restart.
const restartHalfFlag = "restart-half"

// fileTierFlags registers the file tier's flags.
func fileTierFlags(fs *flag.FlagSet, c *config) {
	fs.StringVar(&c.fileTier, "file-tier", "", "-tiers file: the directory of the file tier's blocks (kvtier/filetier); it must exist, and blocks a run stores there are found by the next run")
	fs.BoolVar(&c.restart, "restart", false, "-tiers file: replay the trace in two halves with a restart between them (a new process on the same -file-tier directory), against no restart and against no file tier, and print the second half's hit rates; uses and empties two subdirectories of -file-tier")
	fs.IntVar(&c.restartHalf, restartHalfFlag, 0, "the second process of -restart: replay only this half of the trace, 1 or 2 (hidden)")
}

// fileTierSetup is what -file-tier says.
type fileTierSetup struct {
	dir string
}

// open opens the file tier on its directory, for values of up to valueSize bytes
// (at least filetier's default bound): a warm start on what a run before left there.
// Its lines (what the warm start found) go to stderr.
func (f fileTierSetup) open(valueSize int) (*filetier.Tier, error) {
	var bound int // filetier's default
	if valueSize > filetier.DefaultMaxValueSize {
		bound = valueSize
	}
	ft, err := filetier.New(filetier.Options{Dir: f.dir, MaxValueSize: bound, Logger: slog.New(slog.NewTextHandler(os.Stderr, nil))})
	if err != nil {
		return nil, fmt.Errorf("file tier: %w", err)
	}
	return ft, nil
}

// validateFileTier checks -file-tier, -restart and -restart-half against -tiers.
func (c *config) validateFileTier() error {
	file := false
	for _, n := range splitTiers(c.tiers) {
		file = file || n == tierFile
	}
	switch {
	case c.fileTier != "" && !file:
		return fmt.Errorf("-file-tier needs %s in -tiers", tierFile)
	case file && c.fileTier == "":
		return fmt.Errorf("-tiers %s needs -file-tier DIR", tierFile)
	case c.restart && !file:
		return fmt.Errorf("-restart needs %s in -tiers (and -file-tier DIR)", tierFile)
	case c.restart && c.rounds > 0:
		return fmt.Errorf("-restart can not be used with -rounds %d", c.rounds)
	case c.restartHalf < 0 || c.restartHalf > 2:
		return fmt.Errorf("-%s %d: want 1 or 2", restartHalfFlag, c.restartHalf)
	case file && c.replicas > 1:
		return fmt.Errorf("-tiers %s: one directory serves one replica (-replicas %d)", tierFile, c.replicas)
	}
	if c.fileTier != "" {
		if st, err := os.Stat(c.fileTier); err != nil {
			return fmt.Errorf("-file-tier %s: %w", c.fileTier, err)
		} else if !st.IsDir() {
			return fmt.Errorf("-file-tier %s: not a directory", c.fileTier)
		}
	}
	return nil
}

func splitTiers(s string) []string {
	var out []string
	for _, n := range strings.Split(s, ",") {
		out = append(out, strings.TrimSpace(n))
	}
	return out
}

// restartRequests returns the half of reqs -restart-half asks for, or reqs.
func (c *config) restartRequests(reqs []Request) []Request {
	first, second := halves(reqs)
	switch c.restartHalf {
	case 1:
		return first
	case 2:
		return second
	}
	return reqs
}

// halves splits reqs in two, the first half the shorter when their count is odd.
func halves(reqs []Request) (first, second []Request) {
	h := len(reqs) / 2
	return reqs[:h:h], reqs[h:]
}

// restartRun is one way of serving the trace's second half.
type restartRun struct {
	name string
	res  PrefixResult
}

// runRestart replays w's first half and then its second three ways, and prints the
// second half's hit rates:
//
//   - no restart: one process, one cache and one file tier serve both halves;
//   - restart: this process serves the first half and closes (its blocks stay in
//     the file tier's directory); a new process of this program opens a cache and a
//     file tier on the same directory and serves the second half;
//   - no file tier: a restarted server without it, cold: a fresh prefix cache
//     serves the second half.
func runRestart(ctx context.Context, c *config, s setup, w PrefixWorkload, args []string, traceName string, stdout, stderr io.Writer) int {
	first, second := halves(w.Requests)
	if len(first) == 0 {
		fmt.Fprintf(stderr, "kvcache: -restart: %d requests can not be split in two halves\n", len(w.Requests))
		return 2
	}
	printPrefixHeader(stdout, c, s, w.Requests, traceName)
	fmt.Fprintf(stdout, "Restart: requests 1-%d, then %d-%d after a restart, each run's file tier in a subdirectory of %s\n\n",
		len(first), len(first)+1, len(w.Requests), c.fileTier)
	if !s.tiers.through {
		fmt.Fprintln(stdout, "NB: write-back stores a block only as the device evicts it, so what the device still holds at the restart is lost; -tier-write-through stores it as it is cached")
		fmt.Fprintln(stdout)
	}
	w1, w2 := w, w
	w1.Requests, w2.Requests = first, second
	dirs := map[string]string{}
	for _, sub := range []string{"no-restart", "restart"} {
		d := filepath.Join(c.fileTier, sub)
		if err := errors.Join(os.RemoveAll(d), os.Mkdir(d, 0o755)); err != nil {
			fmt.Fprintf(stderr, "kvcache: -restart: %v\n", err)
			return 1
		}
		dirs[sub] = d
	}
	in := func(dir string) setup {
		t := *s.tiers
		t.file.dir = dir
		s2 := s
		s2.tiers = &t
		return s2
	}
	var runs []restartRun
	step := func(name string, f func() (PrefixResult, error)) bool {
		fmt.Fprintf(stdout, "%s ...", name)
		res, err := f()
		if err != nil {
			fmt.Fprintf(stdout, "\n")
			fmt.Fprintf(stderr, "kvcache: -restart: %s: %v\n", name, err)
			return false
		}
		fmt.Fprintf(stdout, " %v\n", res.Wall.Round(time.Millisecond))
		runs = append(runs, restartRun{name, res})
		return true
	}
	ok := step("no restart", func() (PrefixResult, error) {
		st, _, err := buildPrefixReplica(namePrefixTiers, in(dirs["no-restart"]), 0)
		if err != nil {
			return PrefixResult{}, err
		}
		_, err = ReplayPrefix(ctx, st, w1, func(int) {})
		var res PrefixResult
		if err == nil {
			res, err = ReplayPrefix(ctx, st, w2, func(int) {})
		}
		return res, errors.Join(err, st.Close())
	})
	ok = ok && step("restart (a new process on the same directory)", func() (PrefixResult, error) {
		if _, err := replayPrefixOne(ctx, namePrefixTiers, in(dirs["restart"]), w1); err != nil {
			return PrefixResult{}, fmt.Errorf("first half: %w", err)
		}
		exe, err := os.Executable()
		if err != nil {
			return PrefixResult{}, err
		}
		cargs := append(slices.Clip(args), "-file-tier", dirs["restart"], "-"+restartHalfFlag, "2")
		res, _, err := runChildProcess[PrefixResult](ctx, exe, cargs, namePrefixTiers)
		return res, err
	})
	ok = ok && step("restart without the file tier", func() (PrefixResult, error) {
		return replayPrefixOne(ctx, namePrefixOn, s, w2)
	})
	if !ok {
		return 1
	}
	fmt.Fprintln(stdout)
	printRestartTable(stdout, runs, s.tiers.order)
	return 0
}

// printRestartTable writes the second half's hit rate of each run, over the first's.
func printRestartTable(w io.Writer, runs []restartRun, order []string) {
	fileAt := slices.Index(order, tierFile)
	rate := func(r PrefixResult, h int64) float64 {
		if r.Queries == 0 {
			return 0
		}
		return float64(h) / float64(r.Queries)
	}
	base := rate(runs[0].res, runs[0].res.Hits)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "second half of the trace\thit rate\t/no restart\tfrom the file tier\tchecked\t")
	for _, r := range runs {
		vs := "-"
		if base > 0 {
			vs = fmt.Sprintf("%.1f%%", 100*rate(r.res, r.res.Hits)/base)
		}
		file := "-"
		if fileAt >= 0 && fileAt < len(r.res.TierHits) {
			file = fmt.Sprintf("%.2f%%", 100*rate(r.res, r.res.TierHits[fileAt]))
		}
		fmt.Fprintf(tw, "%s\t%.2f%%\t%s\t%s\t%d tokens\t\n", r.name, 100*rate(r.res, r.res.Hits), vs, file, r.res.Verified)
	}
	tw.Flush()
	fmt.Fprintln(w, `
hit rate            prompt tokens of the second half's requests found cached (device or a tier)
/no restart         that hit rate over the one of the run with no restart
from the file tier  the hit rate's part loaded from the file tier
checked             hit tokens read back and compared, byte for byte, with what was written`)
}
