// Package promtest reads Prometheus metrics in tests as a map from series to value,
// for the tests of metrics and of the example's /metrics endpoint. It is apart from
// testutil so that only the tests that read metrics link the Prometheus client.
package promtest

import (
	"net/http"
	"slices"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Samples returns every sample of mfs by its series, "name{k=v,...}" with the labels
// in order: a gauge's or counter's value, and a histogram's sample count and sum as
// "name_count{...}" and "name_sum{...}".
func Samples(mfs []*dto.MetricFamily) map[string]float64 {
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				ls = append(ls, l.GetName()+"="+l.GetValue())
			}
			slices.Sort(ls)
			series := func(suffix string) string { return mf.GetName() + suffix + "{" + strings.Join(ls, ",") + "}" }
			switch {
			case m.Gauge != nil:
				out[series("")] = m.GetGauge().GetValue()
			case m.Counter != nil:
				out[series("")] = m.GetCounter().GetValue()
			case m.Histogram != nil:
				out[series("_count")] = float64(m.GetHistogram().GetSampleCount())
				out[series("_sum")] = m.GetHistogram().GetSampleSum()
			}
		}
	}
	return out
}

// Gather gathers g and returns its Samples.
func Gather(tb testing.TB, g interface {
	Gather() ([]*dto.MetricFamily, error)
}) map[string]float64 {
	tb.Helper()
	mfs, err := g.Gather()
	if err != nil {
		tb.Fatal(err)
	}
	return Samples(mfs)
}

// Scrape gets url, a /metrics endpoint in Prometheus's text format, and returns its
// Samples; a failed request or a status other than 200 fails tb.
func Scrape(tb testing.TB, url string) map[string]float64 {
	tb.Helper()
	resp, err := http.Get(url)
	if err != nil {
		tb.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		tb.Fatalf("GET %s: %s", url, resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	byName, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		tb.Fatalf("GET %s: %v", url, err)
	}
	mfs := make([]*dto.MetricFamily, 0, len(byName))
	for _, mf := range byName {
		mfs = append(mfs, mf)
	}
	return Samples(mfs)
}
