package kvsub_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vmarena/vmarena/kv"
	"github.com/vmarena/vmarena/kvevents"
	"github.com/vmarena/vmarena/kvevents/kvsub"
)

// TestListen: publishers with Connect dial a Listener (llm-d's global socket);
// it reads each one's batches under its topic, field for field.
func TestListen(t *testing.T) {
	l, err := kvsub.Listen(kvsub.Options{Endpoint: "tcp://127.0.0.1:0", Topic: "kv@"})
	require.NoError(t, err)
	defer l.Close()
	pubs := map[string]*kvevents.Publisher{}
	for _, topic := range []string{"kv@pod-a@m", "kv@pod-b@m"} {
		p, err := kvevents.New(kvevents.Options{Connect: l.Endpoint(), Topic: topic, ReconnectInterval: time.Millisecond, MaxReconnect: 10 * time.Millisecond})
		require.NoError(t, err)
		t.Cleanup(func() { _ = p.Close() })
		pubs[topic] = p
	}
	// A message sent before a publisher has the subscription reaches no one: probe
	// each until one of its probes comes back.
	ready := map[string]bool{}
	stop := make(chan struct{})
	go func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
			for _, p := range pubs {
				p.AllBlocksCleared()
			}
		}
	}()
	for len(ready) < len(pubs) {
		m, err := l.Next()
		if err != nil {
			require.ErrorIs(t, err, kvsub.ErrGap, "a probe sent before the subscription is a gap")
		}
		ready[m.Topic] = true
	}
	close(stop)
	for topic, p := range pubs {
		p.BlocksStored(kv.BlocksStored{Hashes: []uint64{7}, Tokens: []int32{1, 2, 3, 4}, BlockSize: 4, Medium: "CPU", LoRA: topic})
	}
	got := map[string]kvsub.Event{}
	for len(got) < len(pubs) {
		m, err := l.Next()
		if err != nil {
			require.ErrorIs(t, err, kvsub.ErrGap)
		}
		for _, e := range m.Events {
			if e.Kind == kvsub.Stored {
				got[m.Topic] = e
			}
		}
	}
	for topic := range pubs {
		assert.Equal(t, kvsub.Event{Kind: kvsub.Stored, Hashes: []uint64{7}, Tokens: []int32{1, 2, 3, 4}, BlockSize: 4, Medium: "CPU",
			LoRAName: topic, HasGroup: true}, got[topic])
	}
	st := l.Stats()
	assert.Equal(t, 2, st.Publishers)
	assert.Positive(t, st.Live)
	require.NoError(t, l.Close())
	_, err = l.Next()
	assert.ErrorIs(t, err, kvsub.ErrClosed)
	assert.ErrorIs(t, l.Close(), kvsub.ErrClosed, "a second Close changes nothing")
}

// TestListenOptions: a Listener's endpoint is checked, and the options it can not
// honour are refused.
func TestListenOptions(t *testing.T) {
	for _, o := range []kvsub.Options{
		{Endpoint: "127.0.0.1:0"},
		{Endpoint: "tcp://127.0.0.1"},
		{Endpoint: "tcp://127.0.0.1:0", CatchUp: true},
		{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:1"},
	} {
		_, err := kvsub.Listen(o)
		assert.ErrorIs(t, err, kvsub.ErrEndpoint, "%+v", o)
	}
}

// TestListenMaxPublishers: a publisher past MaxPublishers is closed and counted.
func TestListenMaxPublishers(t *testing.T) {
	l, err := kvsub.Listen(kvsub.Options{Endpoint: "tcp://127.0.0.1:0", MaxPublishers: 1})
	require.NoError(t, err)
	defer l.Close()
	for range 2 {
		p, err := kvevents.New(kvevents.Options{Connect: l.Endpoint(), ReconnectInterval: time.Millisecond, MaxReconnect: 5 * time.Millisecond})
		require.NoError(t, err)
		t.Cleanup(func() { _ = p.Close() })
	}
	require.Eventually(t, func() bool { return l.Stats().Refused >= 2 }, 10*time.Second, time.Millisecond, "the second, dialling again, is refused again")
	assert.Equal(t, 1, l.Stats().Publishers)
}
