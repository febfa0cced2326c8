"""Reads the outbox's topic with confluent-kafka and processes each event once, deduplicating on
the `event_id` header (the relay delivers at least once: a message can arrive twice).

Usage: python consumer.py [BOOTSTRAP_SERVERS]
  BOOTSTRAP_SERVERS  argument, else $BOOTSTRAP_SERVERS (default: 127.0.0.1:9092)
  $OUTBOX_TOPIC      topic to read (default: orders)
  $CONSUMER_GROUP    consumer group (default: a new one, so the topic is read from the start)
  $IDLE_SECONDS      stop after this long without a message (default: 5; the wait for the
                     first message, while the consumer joins its group, is at most 60 s)

Prints `event` for each new event, `duplicate` for each copy skipped, and a final `done` line.
"""

import os
import sys
import time
import uuid

from confluent_kafka import Consumer, KafkaException


def main():
    servers = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    topic = os.environ.get("OUTBOX_TOPIC", "orders")
    group = os.environ.get("CONSUMER_GROUP") or f"outbox-example-{uuid.uuid4().hex[:8]}"
    idle = float(os.environ.get("IDLE_SECONDS", "5"))

    consumer = Consumer({
        "bootstrap.servers": servers,
        "group.id": group,
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,  # commit after processing: at least once, like the relay
    })
    consumer.subscribe([topic])
    # In production this set is a table written in the same transaction as the side effect
    # (INSERT INTO processed_events (event_id) ... ON CONFLICT DO NOTHING), see README.md.
    seen = set()
    messages = duplicates = 0
    start = time.monotonic()
    last = None  # the idle clock starts with the first message: joining the group takes a while
    try:
        while (time.monotonic() - last < idle) if last is not None else (time.monotonic() - start < 60):
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                raise KafkaException(msg.error())
            last = time.monotonic()
            messages += 1
            headers = {k: (v or b"").decode() for k, v in (msg.headers() or [])}
            event_id = headers.get("event_id")
            key = (msg.key() or b"").decode()
            if event_id in seen:
                duplicates += 1
                print(f"duplicate key={key} event_id={event_id}")
            else:
                seen.add(event_id)
                # process(msg.value()) goes here
                print(f"event key={key} event_id={event_id} type={headers.get('event_type')}")
            consumer.commit(message=msg, asynchronous=False)
    finally:
        consumer.close()
    print(f"done messages={messages} unique={len(seen)} duplicates={duplicates}")


if __name__ == "__main__":
    main()
