package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing"
	"github.com/vmarena/vmarena/metrics"
)

// metricsServer serves /metrics (-metrics ADDR) while the strategies replay: the
// governor of the strategy replaying now, and for vmarena its cache, pool and prefix
// cache, each series labelled with the strategy. A strategy's series stay until the next one
// starts, so that a scrape after a run reads how it ended.
type metricsServer struct {
	reg *prometheus.Registry
	ln  net.Listener
	srv *http.Server
	err chan error // what Serve returned

	mu  sync.Mutex
	cur prometheus.Collector // registered now, on reg wrapped with the strategy label
	wr  prometheus.Registerer
}

// startMetrics listens on addr (host:port; port 0 picks one) and serves /metrics.
// The server MUST be closed.
func startMetrics(addr string) (*metricsServer, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("-metrics %q: %w", addr, err)
	}
	m := &metricsServer{reg: prometheus.NewRegistry(), ln: ln, err: make(chan error, 1)}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{ErrorHandling: promhttp.HTTPErrorOnError}))
	m.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { m.err <- m.srv.Serve(ln) }()
	return m, nil
}

// Addr returns the address the server listens on.
func (m *metricsServer) Addr() string { return m.ln.Addr().String() }

// watch makes /metrics report strategy name, st bounded by gov on device dev (or on
// its pool's device), in place of the last one.
func (m *metricsServer) watch(name string, gov *accounting.Governor, dev accounting.DeviceKey, st any) error {
	opts := metrics.Options{Governor: gov}
	if src, ok := st.(metricsSource); ok {
		cache, pool, pc := src.metricsSources()
		if d, ok := pool.(interface{ Device() accounting.DeviceKey }); ok {
			dev = d.Device()
		}
		opts.Caches = []metrics.Cache{{Name: name, Cache: cache, Device: dev, Pool: pool, PrefixCache: pc}}
		if pool != nil {
			opts.Pools = []metrics.Pool{{Name: name, Pool: pool}}
		}
		if pc != nil {
			opts.PrefixCaches = []metrics.PrefixCache{{Name: name, Source: pc}}
		}
	}
	c, err := metrics.New(opts)
	if err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cur != nil {
		m.wr.Unregister(m.cur)
	}
	m.wr = prometheus.WrapRegistererWith(prometheus.Labels{"strategy": name}, m.reg)
	m.cur = c
	return m.wr.Register(c)
}

// Close stops serving.
func (m *metricsServer) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := m.srv.Shutdown(ctx)
	if serr := <-m.err; !errors.Is(serr, http.ErrServerClosed) {
		err = errors.Join(err, serr)
	}
	return err
}

// metricsSource is a strategy with a kv cache to report.
type metricsSource interface {
	// metricsSources returns the cache, its pool when the backing pools its memory,
	// and its prefix cache, or nil.
	metricsSources() (metrics.CacheSource, backing.Pool, metrics.PrefixCacheSource)
}

func (s *cacheStrategy) metricsSources() (metrics.CacheSource, backing.Pool, metrics.PrefixCacheSource) {
	return s.c, s.pool, nil
}

func (k *kvPrefix) metricsSources() (metrics.CacheSource, backing.Pool, metrics.PrefixCacheSource) {
	if k.pc == nil {
		return k.cs.metricsSources()
	}
	return k.cs.c, k.cs.pool, metrics.PrefixCacheOf(k.pc)
}
