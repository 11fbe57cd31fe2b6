package metrics_test

import (
	"fmt"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/vmarena/vmarena/accounting"
	"github.com/vmarena/vmarena/backing/host"
	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/metrics"
)

// A server builds one collector over its governor and caches and registers it on a
// registry of its own, which an HTTP handler then serves:
//
//	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
func Example() {
	gov := accounting.NewGovernor()
	_ = gov.SetLimit(accounting.HostKey, 16<<20) // a 16 MiB KV budget
	auth := gov.Authority("kv", accounting.HostKey)
	mem, err := host.NewPrivate(host.PrivateOptions{})
	if err != nil {
		panic(err)
	}
	cache, err := kv.New(mem, kv.Config{Model: kv.Tiny(), MaxTokens: 4096, Authority: auth})
	if err != nil {
		panic(err)
	}
	seq, _ := cache.NewSequence()
	_ = seq.Append(1000) // 1,000 tokens of 256 bytes: 4 granules of 64 KiB

	c, err := metrics.New(metrics.Options{
		Governor: gov,
		Caches:   []metrics.Cache{metrics.CacheOf("tiny", cache, nil)}, // no prefix cache
	})
	if err != nil {
		panic(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)

	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		switch name := mf.GetName(); {
		case strings.HasPrefix(name, "vmarena_kv_cache"), name == "vmarena_kv_tokens", name == "vmarena_governor_used_bytes":
			m := mf.GetMetric()[0]
			fmt.Printf("%s %v\n", name, m.GetGauge().GetValue())
		}
	}
	seq.Close()
	_ = cache.Close()
	// Output:
	// vmarena_governor_used_bytes 262144
	// vmarena_kv_cache_usage_perc 0.015625
	// vmarena_kv_tokens 1000
}
