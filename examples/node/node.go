package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/nodepool"
)

// The two ways the replay splits the node's budget between its two processes.
const (
	modeShared = "one budget"   // both processes draw from the owner's whole budget
	modeStatic = "static split" // each process capped at half of it by its own governor
)

// nodeSample is one reading of the owner's ledger.
type nodeSample struct {
	At    time.Duration // since the replay's start
	Used  int64         // the node's governor: every process's granules
	Owned [2]int64      // each client process's, as the owner charges it (0 when not attached)
}

// runResult is one replay of the workload under one mode.
type runResult struct {
	Mode    string
	Limit   int64 // the node's budget
	Cap     int64 // each process's own cap (0: none)
	Peak    int64 // the owner's governor's peak
	Samples []nodeSample
	Procs   [2]clientResult
	// Waiters and Refusals are the owner's governor's counters.
	Counters accounting.DeviceCounters
}

// replayNode runs the workload once under mode: an owner in this process, with the
// node's budget, and a client process for each of jobs (started from this program's
// executable with clientEnv set), sampling the owner's ledger every o.sample until
// both are done and then for o.idle.
func replayNode(ctx context.Context, o options, mode string, jobs [2][]job, stderr io.Writer) (runResult, error) {
	res := runResult{Mode: mode, Limit: o.budget}
	dir, err := os.MkdirTemp("", "vmarena-node-example")
	if err != nil {
		return res, err
	}
	defer os.RemoveAll(dir)
	gov := accounting.NewGovernor()
	if err := gov.SetLimit(accounting.HostKey, o.budget); err != nil {
		return res, err
	}
	owner, err := nodepool.Listen(filepath.Join(dir, "node.sock"), nodepool.OwnerOptions{Governor: gov, Granularity: o.granule})
	if err != nil {
		return res, err
	}
	defer owner.Close()
	if mode == modeStatic {
		res.Cap = o.budget / 2
	}
	exe, err := os.Executable()
	if err != nil {
		return res, err
	}
	procs := make([]*clientProc, 2)
	defer func() { // on an early return: end whatever still runs
		for _, p := range procs {
			if p != nil {
				_ = p.cmd.Process.Kill()
				_ = p.stop()
			}
		}
	}()
	for i := range procs {
		cfg := clientConfig{Name: processNames[i], Socket: owner.Path(), Model: o.model, MaxTokens: o.maxTokens,
			Limit: res.Cap, Concurrency: o.concurrency, Step: o.step, MaxWait: o.maxWait, WritePrompts: o.write, Jobs: jobs[i]}
		p, err := startClient(ctx, exe, cfg, stderr)
		if err != nil {
			return res, fmt.Errorf("client %s: %w", cfg.Name, err)
		}
		procs[i] = p
	}
	for _, p := range procs {
		if err := p.ready(); err != nil {
			return res, fmt.Errorf("client %s: %w", p.name, err)
		}
	}
	start := time.Now().Add(50 * time.Millisecond)
	for _, p := range procs {
		if _, err := fmt.Fprintln(p.in, start.UnixNano()); err != nil {
			return res, fmt.Errorf("client %s: %w", p.name, err)
		}
	}
	// The results come on their own goroutines; the ledger is sampled here.
	type result struct {
		i   int
		r   clientResult
		err error
	}
	results := make(chan result, 2)
	for i, p := range procs {
		go func() {
			r, err := p.result()
			results <- result{i, r, err}
		}()
	}
	pids := [2]int{procs[0].cmd.Process.Pid, procs[1].cmd.Process.Pid}
	sample := func() {
		st := owner.Stats()
		s := nodeSample{At: time.Since(start), Used: st.Device.Used}
		for _, c := range st.Clients {
			for i, pid := range pids {
				if int(c.PID) == pid {
					s.Owned[i] += c.Owned
				}
			}
		}
		res.Samples = append(res.Samples, s)
	}
	tick := time.NewTicker(o.sample)
	defer tick.Stop()
	var idleFrom time.Time
	pending := 2
	var firstErr error
	// After both are done: o.idle more, and until the node's memory is back to 0
	// (at most settleMax more), so that the report sees when it went back.
	back := func() bool { return len(res.Samples) > 0 && res.Samples[len(res.Samples)-1].Used == 0 }
	for pending > 0 || time.Since(idleFrom) < o.idle || !back() && time.Since(idleFrom) < o.idle+settleMax {
		select {
		case <-ctx.Done():
			return res, ctx.Err()
		case r := <-results:
			pending--
			res.Procs[r.i] = r.r
			res.Procs[r.i].PID = pids[r.i]
			if r.err == nil && r.r.Err != "" {
				r.err = errors.New(r.r.Err)
			}
			if r.err != nil && firstErr == nil {
				firstErr = fmt.Errorf("client %s: %w", processNames[r.i], r.err)
			}
			if pending == 0 {
				idleFrom = time.Now()
			}
		case <-tick.C:
			if time.Since(start) >= 0 {
				sample()
			}
		}
		if firstErr != nil {
			return res, firstErr
		}
	}
	sample()
	st := gov.Stats(accounting.HostKey)
	res.Peak, res.Counters = st.Peak, st.Counters
	for i, p := range procs {
		procs[i] = nil
		if err := p.stop(); err != nil {
			return res, fmt.Errorf("client %s: %w", p.name, err)
		}
	}
	return res, nil
}

// settleMax bounds how long replayNode waits, after o.idle, for the node's memory to
// go back to 0.
const settleMax = 10 * time.Second

// processNames name the two client processes.
var processNames = [2]string{"A", "B"}

// clientProc is a client process as the driver holds it.
type clientProc struct {
	name string
	cmd  *exec.Cmd
	in   io.WriteCloser
	out  *bufio.Reader
}

func startClient(ctx context.Context, exe string, cfg clientConfig, stderr io.Writer) (*clientProc, error) {
	cmd := exec.CommandContext(ctx, exe)
	cmd.Env = append(os.Environ(), clientEnv+"=1")
	cmd.Stderr = stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &clientProc{name: cfg.Name, cmd: cmd, in: in, out: bufio.NewReader(out)}
	if err := json.NewEncoder(in).Encode(cfg); err != nil {
		_ = cmd.Process.Kill()
		_ = p.stop()
		return nil, err
	}
	return p, nil
}

// ready waits for the process to say it attached.
func (p *clientProc) ready() error {
	line, err := p.out.ReadString('\n')
	if err != nil {
		return fmt.Errorf("before it was ready: %w", err)
	}
	if line != "ready\n" {
		return fmt.Errorf("said %q, not ready", line)
	}
	return nil
}

// result reads the process's result line.
func (p *clientProc) result() (clientResult, error) {
	var r clientResult
	line, err := p.out.ReadBytes('\n')
	if err != nil {
		return r, fmt.Errorf("no result: %w", err)
	}
	return r, json.Unmarshal(line, &r)
}

// stop closes the process's input, which ends it, and waits for it.
func (p *clientProc) stop() error {
	_ = p.in.Close()
	if err := p.cmd.Wait(); err != nil {
		return fmt.Errorf("pid %s: %w", strconv.Itoa(p.cmd.Process.Pid), err)
	}
	return nil
}
