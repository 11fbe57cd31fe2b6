"""A subscriber on the real libzmq (Debian's python3-zmq and python3-msgpack), for
kvevents' libzmq tests. It decodes every payload with its own definition of vLLM's
EventBatch and events, written out below field by field from the structs of vLLM's
example subscriber (examples/online_serving/kv_events_subscriber.py) and
vllm/distributed/kv_events.py, and shares nothing with kvevents' encoder.

Usage:
  libzmq_subscriber.py dial PUB_ENDPOINT REPLAY_ENDPOINT TOPIC
      a SUB, subscribed to TOPIC (a prefix), that connects to the publisher (the
      publisher binds); prints
      "subscribed", reads "done N" (N messages were published), checks the live
      stream against the replay socket, prints one JSON line.
  libzmq_subscriber.py bind TOPIC
      a SUB that binds (llm-d's "global socket"; the publisher connects to it);
      prints "bound ENDPOINT", reads "done N REPLAY_ENDPOINT", then as dial.
  libzmq_subscriber.py check HEX...
      decodes each payload given in hex; prints one JSON line per payload,
      {"ok": events} or {"error": why}.
Exits 0, or non-zero with the reason on stderr.
"""

import json
import select
import sys

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Malformed(Exception):
    pass


# The layout, written out from vLLM's definitions (not from kvevents):
#
# EventBatch(msgspec.Struct, array_like=True, omit_defaults=True): always a
# positional array, in every release. Its fields, in order, and how many of them
# have no default (ts and events; data_parallel_rank defaults to None).
BATCH_FIELDS = ("ts", "events", "data_parallel_rank")
BATCH_REQUIRED = 2

# KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True): the tag is the class
# name. vLLM v0.26.0 sends each event as a map with the tag under "type"; v0.23.0
# and before (array_like=True as well) as an array with the tag first. Each class's
# fields in declared order, with the number that have no default, and the msgpack
# types each may take (None for Optional).
INT, STR, LIST, NONE = "int", "str", "list", "none"
EVENTS = {
    "BlockStored": (
        (
            ("block_hashes", (LIST,)),
            ("parent_block_hash", (INT, NONE)),
            ("token_ids", (LIST,)),
            ("block_size", (INT,)),
            ("lora_id", (INT, NONE)),
            ("medium", (STR, NONE)),
            ("lora_name", (STR, NONE)),
            ("extra_keys", (LIST, NONE)),
            ("group_idx", (INT, NONE)),
            ("kv_cache_spec_kind", (STR, NONE)),
            ("kv_cache_spec_sliding_window", (INT, NONE)),
        ),
        7,
    ),
    "BlockRemoved": (
        (
            ("block_hashes", (LIST,)),
            ("medium", (STR, NONE)),
            ("group_idx", (INT, NONE)),
        ),
        2,
    ),
    "AllBlocksCleared": ((), 0),
}


def typeof(v):
    if v is None:
        return NONE
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return INT
    if isinstance(v, str):
        return STR
    if isinstance(v, list):
        return LIST
    return type(v).__name__


def check_field(tag, name, types, v):
    if typeof(v) not in types:
        raise Malformed("%s.%s is a %s" % (tag, name, typeof(v)))
    if name in ("block_hashes", "token_ids"):
        for x in v:
            if typeof(x) != INT:
                raise Malformed("%s.%s holds a %s" % (tag, name, typeof(x)))
    return v


def decode_event(ev):
    """The event as [form, [[field, value], ...]] in wire order, type first."""
    if isinstance(ev, dict):
        keys = list(ev)
        if not keys or keys[0] != "type":
            raise Malformed("a map event not led by its type: %r" % (keys,))
        tag = ev["type"]
        if tag not in EVENTS:
            raise Malformed("event type %r" % (tag,))
        fields, required = EVENTS[tag]
        declared = [name for name, _ in fields]
        present = keys[1:]
        if [k for k in present if k not in declared]:
            raise Malformed("%s: unknown fields %r" % (tag, present))
        if present != [k for k in declared if k in present]:
            raise Malformed("%s: fields out of declared order %r" % (tag, present))
        missing = [k for k in declared[:required] if k not in present]
        if missing:
            raise Malformed("%s without %r" % (tag, missing))
        types = dict(fields)
        return ["map", [["type", tag]] + [[k, check_field(tag, k, types[k], ev[k])] for k in present]]
    if isinstance(ev, list):
        if not ev or not isinstance(ev[0], str):
            raise Malformed("an array event not led by its type")
        tag = ev[0]
        if tag not in EVENTS:
            raise Malformed("event type %r" % (tag,))
        fields, required = EVENTS[tag]
        values = ev[1:]
        if len(values) < required or len(values) > len(fields):
            raise Malformed("%s of %d fields, not %d to %d" % (tag, len(values), required, len(fields)))
        return ["array", [["type", tag]] + [[name, check_field(tag, name, types, v)] for (name, types), v in zip(fields, values)]]
    raise Malformed("an event that is a %s" % typeof(ev))


def decode_batch(payload):
    """The batch as (ts, rank, [event, ...])."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    if not isinstance(batch, list):
        raise Malformed("the batch is a %s, not an array" % typeof(batch))
    if len(batch) < BATCH_REQUIRED or len(batch) > len(BATCH_FIELDS):
        raise Malformed("a batch array of %d elements" % len(batch))
    ts, events = batch[0], batch[1]
    rank = batch[2] if len(batch) > 2 else None
    if not isinstance(ts, float):
        raise Malformed("ts is a %s" % typeof(ts))
    if not isinstance(events, list):
        raise Malformed("events is a %s" % typeof(events))
    if typeof(rank) not in (INT, NONE):
        raise Malformed("data_parallel_rank is a %s" % typeof(rank))
    return ts, rank, [decode_event(ev) for ev in events]


def fail(why):
    sys.stderr.write("libzmq_subscriber: " + why + "\n")
    sys.exit(1)


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


def collect(sub, topic, n, replay_ep, ctx):
    live, topics = {}, set()
    while len(live) < n:
        try:
            frames = sub.recv_multipart()
        except zmq.Again:
            fail("live stream: %d of %d messages, then nothing for 10 s" % (len(live), n))
        if len(frames) != 3:
            fail("a message of %d frames, not 3" % len(frames))
        if not frames[0].startswith(topic):
            fail("topic %r, not under %r" % (frames[0], topic))
        topics.add(frames[0].decode())
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
        try:
            _, rank, evs = decode_batch(payload)
        except (Malformed, ValueError, msgpack.exceptions.UnpackException) as e:
            fail("message %d: %s" % (seq, e))
        ranks.add(rank)
        events.extend(evs)
    print(json.dumps({"messages": n, "topics": sorted(topics), "ranks": sorted(ranks), "events": events}), flush=True)


def sub_socket(ctx, topic):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, 10000)
    sub.setsockopt(zmq.LINGER, 0)
    return sub


def main():
    mode = sys.argv[1]
    ctx = zmq.Context()
    if mode == "check":
        for h in sys.argv[2:]:
            try:
                _, _, evs = decode_batch(bytes.fromhex(h))
                print(json.dumps({"ok": evs}), flush=True)
            except (Malformed, ValueError, msgpack.exceptions.UnpackException) as e:
                print(json.dumps({"error": str(e)}), flush=True)
        return
    if mode == "dial":
        pub_ep, replay_ep, topic = sys.argv[2], sys.argv[3], sys.argv[4].encode()
        sub = sub_socket(ctx, topic)
        sub.connect(pub_ep)
        print("subscribed", flush=True)
        line = sys.stdin.readline().split()
        if len(line) != 2 or line[0] != "done":
            fail("expected 'done N' on stdin, got %r" % (line,))
    elif mode == "bind":
        topic = sys.argv[2].encode()
        sub = sub_socket(ctx, topic)
        sub.bind("tcp://127.0.0.1:*")
        print("bound " + sub.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
        # libzmq attaches a connection that came in, and sends it the subscription,
        # only inside a call on the socket: make them while waiting, as a SUB in a
        # receive loop does.
        while not select.select([sys.stdin], [], [], 0.01)[0]:
            sub.getsockopt(zmq.EVENTS)
        line = sys.stdin.readline().split()
        if len(line) != 3 or line[0] != "done":
            fail("expected 'done N REPLAY_ENDPOINT' on stdin, got %r" % (line,))
        replay_ep = line[2]
    else:
        fail("mode %r" % mode)
    collect(sub, topic, int(line[1]), replay_ep, ctx)


if __name__ == "__main__":
    main()
