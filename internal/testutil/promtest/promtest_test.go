package promtest_test

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/stretchr/testify/assert"

	"github.com/vmarena/vmarena/internal/testutil/promtest"
)

// registry holds a gauge, a counter with two labels (given out of order) and a
// histogram of two observations.
func registry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "t_gauge"})
	g.Set(2.5)
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "t_total"}, []string{"zone", "app"})
	c.WithLabelValues("a", "b").Add(3)
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "t_seconds", Buckets: []float64{1}})
	h.Observe(0.5)
	h.Observe(4)
	reg.MustRegister(g, c, h)
	return reg
}

var want = map[string]float64{
	"t_gauge{}":             2.5,
	"t_total{app=b,zone=a}": 3,
	"t_seconds_count{}":     2,
	"t_seconds_sum{}":       4.5,
}

func TestGather(t *testing.T) {
	assert.Equal(t, want, promtest.Gather(t, registry()))
}

func TestScrape(t *testing.T) {
	srv := httptest.NewServer(promhttp.HandlerFor(registry(), promhttp.HandlerOpts{}))
	defer srv.Close()
	assert.Equal(t, want, promtest.Scrape(t, srv.URL), "the text format reads as Gather does")
}

func TestScrapeStatus(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	defer srv.Close()
	r := &recorder{TB: t}
	promtest.Scrape(r, srv.URL)
	assert.True(t, r.failed, "a 404 fails the test")
}

// recorder is a testing.TB whose Fatalf records the failure instead of ending the test.
type recorder struct {
	testing.TB
	failed bool
}

func (r *recorder) Fatalf(string, ...any) { r.failed = true }
