package metrics_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kvevents"
	"github.com/vmarena/vmarena/metrics"
)

func TestCollectEventPublishers(t *testing.T) {
	src := metrics.EventPublisherFunc(func() metrics.EventPublisherStats {
		return metrics.EventPublisherStats{Published: 900, Dropped: 7, SubscriberDrops: 40, QueueDepth: 12, Subscribers: 3,
			Replays: 5, ReplaysRefused: 2, ReplaysAborted: 1, BadRequests: 4}
	})
	c, err := metrics.New(metrics.Options{EventPublishers: []metrics.EventPublisher{{Name: "replica-0", Source: src}}})
	require.NoError(t, err)
	want := `
# HELP vmarena_kv_events_dropped_total KV events dropped because the publisher's queue was full (or it was closed).
# TYPE vmarena_kv_events_dropped_total counter
vmarena_kv_events_dropped_total{publisher="replica-0"} 7
# HELP vmarena_kv_events_published_total KV events sent to subscribers.
# TYPE vmarena_kv_events_published_total counter
vmarena_kv_events_published_total{publisher="replica-0"} 900
# HELP vmarena_kv_events_queue_depth KV events waiting to be sent.
# TYPE vmarena_kv_events_queue_depth gauge
vmarena_kv_events_queue_depth{publisher="replica-0"} 12
# HELP vmarena_kv_events_replay_requests_total Replay requests, by outcome: served, refused (too many at once), aborted (client gone or not reading), malformed.
# TYPE vmarena_kv_events_replay_requests_total counter
vmarena_kv_events_replay_requests_total{outcome="aborted",publisher="replica-0"} 1
vmarena_kv_events_replay_requests_total{outcome="malformed",publisher="replica-0"} 4
vmarena_kv_events_replay_requests_total{outcome="refused",publisher="replica-0"} 2
vmarena_kv_events_replay_requests_total{outcome="served",publisher="replica-0"} 5
# HELP vmarena_kv_events_subscriber_drops_total KV-event messages a subscriber's full queue did not take.
# TYPE vmarena_kv_events_subscriber_drops_total counter
vmarena_kv_events_subscriber_drops_total{publisher="replica-0"} 40
# HELP vmarena_kv_events_subscribers Subscribers connected.
# TYPE vmarena_kv_events_subscribers gauge
vmarena_kv_events_subscribers{publisher="replica-0"} 3
`
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(want)))
	problems, err := testutil.CollectAndLint(c)
	require.NoError(t, err)
	assert.Empty(t, problems)
	registry(t, c) // Describe and Collect agree (a pedantic registry checks)
}

func TestEventPublishersBadOptions(t *testing.T) {
	src := metrics.EventPublisherFunc(func() metrics.EventPublisherStats { return metrics.EventPublisherStats{} })
	for _, tt := range []struct {
		name string
		pubs []metrics.EventPublisher
		msg  string
	}{
		{"nil source", []metrics.EventPublisher{{Name: "p"}}, `event publisher "p" has no source`},
		{"no name", []metrics.EventPublisher{{Source: src}}, "event publisher 0 has no name"},
		{"two of one name", []metrics.EventPublisher{{Name: "p", Source: src}, {Name: "p", Source: src}}, `two event publishers named "p"`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := metrics.New(metrics.Options{EventPublishers: tt.pubs})
			assert.ErrorIs(t, err, metrics.ErrOptions)
			assert.ErrorContains(t, err, tt.msg)
		})
	}
}

// publisherSource adapts a kvevents.Publisher, as a server does.
func publisherSource(p *kvevents.Publisher) metrics.EventPublisherSource {
	return metrics.EventPublisherFunc(func() metrics.EventPublisherStats {
		s := p.Stats()
		return metrics.EventPublisherStats{
			Published: s.Published, Dropped: s.Dropped, SubscriberDrops: s.SubscriberDrops,
			QueueDepth: s.QueueDepth, Subscribers: s.Subscribers, Replays: s.Replays,
			ReplaysRefused: s.ReplaysRefused, ReplaysAborted: s.ReplaysAborted, BadRequests: s.BadRequests,
		}
	})
}

// ExampleEventPublisherFunc collects a KV-event publisher (package kvevents),
// adapted by a function so that metrics imports no transport.
func ExampleEventPublisherFunc() {
	pub, err := kvevents.New(kvevents.Options{Endpoint: "tcp://127.0.0.1:0"})
	if err != nil {
		panic(err)
	}
	pub.AllBlocksCleared()
	_ = pub.Close() // publishes what is queued
	c, err := metrics.New(metrics.Options{
		EventPublishers: []metrics.EventPublisher{{Name: "replica-0", Source: publisherSource(pub)}},
	})
	if err != nil {
		panic(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	families, err := reg.Gather()
	if err != nil {
		panic(err)
	}
	for _, f := range families {
		if m := f.GetMetric()[0]; f.GetType() == dto.MetricType_COUNTER && !strings.Contains(f.GetName(), "replay") {
			fmt.Println(f.GetName(), m.GetCounter().GetValue())
		}
	}
	// Output:
	// vmarena_kv_events_dropped_total 0
	// vmarena_kv_events_published_total 1
	// vmarena_kv_events_subscriber_drops_total 0
}
