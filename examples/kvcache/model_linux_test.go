package main

import "testing"

// TestReplayHybridSystemPrompt replays gpt-oss-20b on a system prompt longer than its
// window, held as a sequence of its own and forked by every request (the shared
// backing maps it): the groups' figures still add up to the cache's, the window group
// stays bounded with one more window for the prompt, and the need counts the prompt
// once.
func TestReplayHybridSystemPrompt(t *testing.T) {
	replayHybrid(t, "shared", 300, false)
}

// TestReplayHybridMapAhead is TestReplayHybridSystemPrompt with map-ahead on: each
// group's next block is committed ahead of the step, and the figures, the bytes read
// back and the window's bound are as without it.
func TestReplayHybridMapAhead(t *testing.T) {
	replayHybrid(t, "shared", 300, true)
}
