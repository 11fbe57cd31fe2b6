package metrics

import "github.com/prometheus/client_golang/prometheus"

// EventPublisherStats is a snapshot of a KV-event publisher's counters (package
// kvevents' Publisher.Stats has each of them). Events are kv.BlockEvents calls;
// messages are the batches put on the wire.
type EventPublisherStats struct {
	Published       int64 // events sent, in all
	Dropped         int64 // events the publisher's queue did not take (full, or closed), in all
	SubscriberDrops int64 // messages a subscriber's full queue did not take, in all
	QueueDepth      int   // events waiting to be sent now
	Subscribers     int   // subscribers connected now
	Replays         int64 // replays served, in all
	ReplaysRefused  int64 // replay requests dropped at the limit of replays at once, in all
	ReplaysAborted  int64 // replays cut off (client gone or not reading), in all
	BadRequests     int64 // malformed replay requests dropped, in all
}

// EventPublisherSource is what a KV-event publisher must provide to be collected.
// metrics imports no transport: adapt a *kvevents.Publisher with EventPublisherFunc,
// as its Example shows.
type EventPublisherSource interface {
	EventPublisherStats() EventPublisherStats
}

// EventPublisherFunc adapts a function to an EventPublisherSource.
type EventPublisherFunc func() EventPublisherStats

// EventPublisherStats returns f().
func (f EventPublisherFunc) EventPublisherStats() EventPublisherStats { return f() }

// EventPublisher names a KV-event publisher to collect.
type EventPublisher struct {
	Name   string // the publisher label; unique among Options.EventPublishers
	Source EventPublisherSource
}

type eventDescs struct {
	published, dropped, subscriberDrops, queueDepth, subscribers, replays *prometheus.Desc
}

func newEventDescs(ns string) eventDescs {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(ns, "", name), help, labels, nil)
	}
	return eventDescs{
		published:       d("kv_events_published_total", "KV events sent to subscribers.", "publisher"),
		dropped:         d("kv_events_dropped_total", "KV events dropped because the publisher's queue was full (or it was closed).", "publisher"),
		subscriberDrops: d("kv_events_subscriber_drops_total", "KV-event messages a subscriber's full queue did not take.", "publisher"),
		queueDepth:      d("kv_events_queue_depth", "KV events waiting to be sent.", "publisher"),
		subscribers:     d("kv_events_subscribers", "Subscribers connected.", "publisher"),
		replays:         d("kv_events_replay_requests_total", "Replay requests, by outcome: served, refused (too many at once), aborted (client gone or not reading), malformed.", "publisher", "outcome"),
	}
}

func (d *eventDescs) all() []*prometheus.Desc {
	return []*prometheus.Desc{d.published, d.dropped, d.subscriberDrops, d.queueDepth, d.subscribers, d.replays}
}

func (c *Collector) collectEventPublisher(ch chan<- prometheus.Metric, p EventPublisher) {
	s := p.Source.EventPublisherStats()
	d := &c.ev
	counter(ch, d.published, s.Published, p.Name)
	counter(ch, d.dropped, s.Dropped, p.Name)
	counter(ch, d.subscriberDrops, s.SubscriberDrops, p.Name)
	gauge(ch, d.queueDepth, float64(s.QueueDepth), p.Name)
	gauge(ch, d.subscribers, float64(s.Subscribers), p.Name)
	counter(ch, d.replays, s.Replays, p.Name, "served")
	counter(ch, d.replays, s.ReplaysRefused, p.Name, "refused")
	counter(ch, d.replays, s.ReplaysAborted, p.Name, "aborted")
	counter(ch, d.replays, s.BadRequests, p.Name, "malformed")
}
