"""A subscriber on the real libzmq (Debian's python3-zmq and python3-msgpack), for
kvevents' TestLibzmqSubscriber: it subscribes to the publisher, asks the replay
socket for everything, checks the two streams against each other and vLLM's
framing, and prints every event it decoded, as JSON, for the Go side to compare
with what it sent.

Usage: libzmq_subscriber.py PUB_ENDPOINT REPLAY_ENDPOINT TOPIC
Protocol on stdin/stdout: prints "subscribed"; reads "done N" (N messages were
published); prints one JSON line; exits 0, or non-zero with the reason on stderr.
"""

import json
import sys

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def fail(why):
    sys.stderr.write("libzmq_subscriber: " + why + "\n")
    sys.exit(1)


def ordered(v):
    """A decoded value with every map as a list of [key, value], in wire order."""
    if isinstance(v, dict):
        return [[k, ordered(x)] for k, x in v.items()]
    if isinstance(v, (list, tuple)):
        return [ordered(x) for x in v]
    return v


def replay(dealer, start):
    """Every (seq, payload) the replay socket sends from start on, up to its end marker."""
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        frames = dealer.recv_multipart()
        if len(frames) != 3 or frames[0] != b"" or len(frames[1]) != 8:
            fail("replay reply of shape %r" % ([len(f) for f in frames],))
        if frames[1] == END_SEQ:
            if frames[2] != b"":
                fail("end marker with a payload")
            return out
        out.append((int.from_bytes(frames[1], "big"), frames[2]))


def main():
    pub_ep, replay_ep, topic = sys.argv[1], sys.argv[2], sys.argv[3].encode()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, 10000)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(pub_ep)
    print("subscribed", flush=True)

    line = sys.stdin.readline().split()
    if len(line) != 2 or line[0] != "done":
        fail("expected 'done N' on stdin, got %r" % (line,))
    n = int(line[1])

    live = {}
    while len(live) < n:
        try:
            frames = sub.recv_multipart()
        except zmq.Again:
            fail("live stream: %d of %d messages, then nothing for 10 s" % (len(live), n))
        if len(frames) != 3:
            fail("a message of %d frames, not 3" % len(frames))
        if frames[0] != topic:
            fail("topic %r" % frames[0])
        if len(frames[1]) != 8:
            fail("a sequence number of %d bytes" % len(frames[1]))
        live[int.from_bytes(frames[1], "big")] = frames[2]
    if sorted(live) != list(range(n)):
        fail("live sequence numbers %r" % sorted(live))

    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 10000)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay_ep)
    # Malformed requests, each dropped by the publisher without an answer: a short
    # start number, a first frame that is not empty, one frame too many.
    dealer.send_multipart([b"", b"\x00" * 7])
    dealer.send_multipart([b"x", b"\x00" * 8])
    dealer.send_multipart([b"", b"\x00" * 8, b"extra"])
    # Past the end: the end marker alone (also proves the socket survived the above).
    if replay(dealer, n) != []:
        fail("a replay from past the end returned messages")
    got = replay(dealer, 0)
    if [s for s, _ in got] != list(range(n)):
        fail("replay sequence numbers %r" % [s for s, _ in got])
    tail = replay(dealer, n - 2)
    if [s for s, _ in tail] != [n - 2, n - 1]:
        fail("replay from %d: %r" % (n - 2, [s for s, _ in tail]))

    events, ranks = [], set()
    for seq, payload in got:
        if live[seq] != payload:
            fail("message %d: the live and replayed payloads differ" % seq)
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        if not isinstance(batch, dict):
            fail("message %d: the batch is a %s, not a map" % (seq, type(batch).__name__))
        if list(batch) != ["ts", "events", "data_parallel_rank"]:
            fail("message %d: batch keys %r" % (seq, list(batch)))
        if not isinstance(batch["ts"], float):
            fail("message %d: ts is a %s" % (seq, type(batch["ts"]).__name__))
        ranks.add(batch["data_parallel_rank"])
        for ev in batch["events"]:
            if not isinstance(ev, dict) or next(iter(ev)) != "type":
                fail("message %d: an event that is not a map led by its type: %r" % (seq, ev))
            events.append(ordered(ev))
    print(json.dumps({"messages": n, "ranks": sorted(ranks), "events": events}), flush=True)


if __name__ == "__main__":
    main()
