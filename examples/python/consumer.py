"""Reads the outbox's topic with confluent-kafka and applies each event's effect exactly once: the
effect (a customer's loyalty points) and the event's id in the inbox commit in one PostgreSQL
transaction, and only then is the Kafka offset committed (docs/inbox.md).

Usage: python consumer.py DATABASE_URL [BOOTSTRAP_SERVERS]
  DATABASE_URL       the consumer's database (with the outbox extension and loyalty_points)
  BOOTSTRAP_SERVERS  argument, else $BOOTSTRAP_SERVERS (default: 127.0.0.1:9092)
  $OUTBOX_TOPIC      topic to read (default: orders)
  $CONSUMER_NAME     the inbox's consumer, a role the database user is a member of (default: loyalty)
  $CONSUMER_GROUP    consumer group (default: a new one, so the topic is read from the start)
  $CONSUMER_INSTANCE the member's group.instance.id (static membership: a restarted consumer
                     takes its partitions back at once instead of after the session timeout)
  $IDLE_SECONDS      stop after this long without a message (default: 5; the wait for the
                     first message, while the consumer joins its group, is at most 60 s)
  $EXIT_AFTER_COMMITS  fault injection: SIGKILL itself after that many database commits, before
                     the offset commit (the restarted consumer gets that message again)

Prints `applied` for each event applied, `duplicate` for each one the inbox had already seen,
and a final `done` line.
"""

import json
import os
import signal
import sys
import time
import uuid

import psycopg
from confluent_kafka import Consumer, KafkaException

APPLY = """
    INSERT INTO loyalty_points (customer, points) VALUES (%s, %s)
    ON CONFLICT (customer) DO UPDATE SET points = loyalty_points.points + EXCLUDED.points
"""


def handle(conn, consumer_name, msg):
    """One transaction: the inbox says whether the event is new; only then the effect."""
    headers = {k: (v or b"").decode() for k, v in (msg.headers() or [])}
    event_id = headers["event_id"]
    with conn.transaction():
        new = conn.execute("SELECT outbox_inbox_accept(%s, %s::uuid)",
                           (consumer_name, event_id)).fetchone()[0]
        if new:
            event = json.loads(msg.value())
            conn.execute(APPLY, (event["customer"], event["points"]))
    return new, event_id


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    url = sys.argv[1]
    servers = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    topic = os.environ.get("OUTBOX_TOPIC", "orders")
    consumer_name = os.environ.get("CONSUMER_NAME", "loyalty")
    group = os.environ.get("CONSUMER_GROUP") or f"outbox-example-{uuid.uuid4().hex[:8]}"
    idle = float(os.environ.get("IDLE_SECONDS", "5"))
    exit_after = int(os.environ.get("EXIT_AFTER_COMMITS", "0"))

    config = {
        "bootstrap.servers": servers,
        "group.id": group,
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,  # the offset is committed after the database commit
    }
    if os.environ.get("CONSUMER_INSTANCE"):
        config["group.instance.id"] = os.environ["CONSUMER_INSTANCE"]
    consumer = Consumer(config)
    consumer.subscribe([topic])
    messages = applied = duplicates = 0
    start = time.monotonic()
    last = None  # the idle clock starts with the first message: joining the group takes a while
    with psycopg.connect(url, autocommit=True) as conn:
        try:
            while (time.monotonic() - last < idle) if last is not None else (time.monotonic() - start < 60):
                msg = consumer.poll(0.5)
                if msg is None:
                    continue
                if msg.error():
                    raise KafkaException(msg.error())
                last = time.monotonic()
                messages += 1
                new, event_id = handle(conn, consumer_name, msg)
                key = (msg.key() or b"").decode()
                if new:
                    applied += 1
                    print(f"applied key={key} event_id={event_id}", flush=True)
                else:
                    duplicates += 1
                    print(f"duplicate key={key} event_id={event_id}", flush=True)
                if messages == exit_after:
                    os.kill(os.getpid(), signal.SIGKILL)
                # A crash before this line redelivers the message; the inbox makes it a no-op.
                consumer.commit(message=msg, asynchronous=False)
        finally:
            consumer.close()
    print(f"done messages={messages} applied={applied} duplicates={duplicates}")


if __name__ == "__main__":
    main()
