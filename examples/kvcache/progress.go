package main

import (
	"fmt"
	"io"
	"os"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"
)

// progressUI shows a replay as it runs.
type progressUI interface {
	start(name string, total int)
	update(done int, s Sample)
	finish(r Result, err error)
}

// newProgress returns the display mode asks for: a live bar on a terminal, a few
// plain lines otherwise (CI logs, pipes, tests), or nothing.
func newProgress(mode string, w io.Writer) progressUI {
	if mode == "auto" {
		mode = "lines"
		if f, ok := w.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
			mode = "bar"
		}
	}
	switch mode {
	case "bar":
		return &barProgress{w: w}
	case "lines":
		return &lineProgress{w: w}
	}
	return nopProgress{}
}

type nopProgress struct{}

func (nopProgress) start(string, int)    {}
func (nopProgress) update(int, Sample)   {}
func (nopProgress) finish(Result, error) {}

// barProgress draws one progress bar per strategy.
type barProgress struct {
	w    io.Writer
	name string
	bar  *progressbar.ProgressBar
}

func (p *barProgress) start(name string, total int) {
	p.name = name
	p.bar = progressbar.NewOptions(total,
		progressbar.OptionSetWriter(p.w),
		progressbar.OptionSetDescription(fmt.Sprintf("%-8s", name)),
		progressbar.OptionSetWidth(20),
		progressbar.OptionShowCount(),
		progressbar.OptionSetPredictTime(false),
		progressbar.OptionThrottle(100*time.Millisecond),
		progressbar.OptionSetTheme(progressbar.Theme{Saucer: "=", SaucerHead: ">", SaucerPadding: " ", BarStart: "[", BarEnd: "]"}),
	)
}

func (p *barProgress) update(done int, s Sample) {
	// Short enough for an 80-column terminal with the bar and the count.
	p.bar.Describe(fmt.Sprintf("%-8s %9s held, %3d running, %3d waiting", p.name, formatBytes(s.Physical), s.Running, s.Waiting))
	_ = p.bar.Set(done)
}

func (p *barProgress) finish(r Result, err error) {
	_ = p.bar.Finish()
	fmt.Fprintln(p.w)
	fmt.Fprintln(p.w, summaryLine(r, err))
}

// lineProgress prints a line at every quarter of the requests.
type lineProgress struct {
	w     io.Writer
	name  string
	total int
	next  int
	peak  int64
}

func (p *lineProgress) start(name string, total int) {
	p.name, p.total, p.next, p.peak = name, total, 1, 0
	fmt.Fprintf(p.w, "%-8s replaying %d requests\n", name, total)
}

func (p *lineProgress) update(done int, s Sample) {
	p.peak = max(p.peak, s.Physical)
	for p.next <= 3 && done*4 >= p.total*p.next {
		fmt.Fprintf(p.w, "%-8s %3d%%  %d/%d requests, %s held, %s peak, %d running, %d waiting\n",
			p.name, 25*p.next, done, p.total, formatBytes(s.Physical), formatBytes(p.peak), s.Running, s.Waiting)
		p.next++
	}
}

func (p *lineProgress) finish(r Result, err error) {
	fmt.Fprintln(p.w, summaryLine(r, err))
}

func summaryLine(r Result, err error) string {
	if err != nil {
		return fmt.Sprintf("%-8s failed: %v", r.Strategy, err)
	}
	return fmt.Sprintf("%-8s done: %d/%d requests in %v (wall), peak %s", r.Strategy, r.Completed, r.Requests,
		r.Wall.Round(time.Millisecond), formatBytes(r.PeakPhysical))
}
