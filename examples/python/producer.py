"""Orders and their outbox events in one transaction, with psycopg 3.

Usage: python producer.py [DATABASE_URL]
  DATABASE_URL  libpq URL or key=value string (argument, else $DATABASE_URL)
  $OUTBOX_TOPIC topic of the events (default: orders)
  $RUN_ID       makes the order numbers unique per run (default: a random one)

Prints one line per outcome (committed / rolled_back / invalid) and a final `done` line.
"""

import os
import sys
import uuid
from decimal import Decimal

import psycopg
from psycopg.types.json import Jsonb

ENQUEUE = """
SELECT outbox_enqueue(topic => %s, payload => %s, key => %s, event_type => %s)
"""

SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
  id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  order_no text NOT NULL UNIQUE,
  customer text NOT NULL,
  total numeric(10,2) NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now()
)
"""


def place_order(cur, topic, order_no, customer, total):
    """The business row and its event, in the caller's transaction. Returns the outbox id."""
    cur.execute(
        "INSERT INTO orders (order_no, customer, total) VALUES (%s, %s, %s) RETURNING id",
        (order_no, customer, total),
    )
    (order_id,) = cur.fetchone()
    payload = {"order_id": order_id, "order_no": order_no, "customer": customer, "total": str(total)}
    cur.execute(ENQUEUE, (topic, Jsonb(payload), order_no, "OrderCreated"))
    (outbox_id,) = cur.fetchone()
    return outbox_id


def main():
    url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("DATABASE_URL")
    if not url:
        sys.exit("usage: producer.py DATABASE_URL (or set $DATABASE_URL)")
    topic = os.environ.get("OUTBOX_TOPIC", "orders")
    run = os.environ.get("RUN_ID") or uuid.uuid4().hex[:12]
    committed = 0
    invalid_sqlstate = None

    with psycopg.connect(url) as conn:
        conn.execute(SCHEMA)
        conn.commit()

        # 1. One order, one event; a bad call in a savepoint does not spoil the transaction.
        with conn.transaction():
            with conn.cursor() as cur:
                key = f"python-{run}-1"
                oid = place_order(cur, topic, key, "alice", Decimal("19.90"))
                try:
                    with conn.transaction():  # nested: SAVEPOINT ... RELEASE / ROLLBACK TO
                        cur.execute(ENQUEUE, ("not a topic!", Jsonb({}), key, "OrderCreated"))
                except psycopg.Error as e:
                    if e.sqlstate != "22023":  # invalid_parameter_value
                        raise
                    invalid_sqlstate = e.sqlstate
                    print(f"invalid sqlstate={e.sqlstate} message={e.diag.message_primary}")
        print(f"committed key={key} outbox_id={oid}")
        committed += 1

        # 2. A batch: several orders and their events, one transaction, one commit.
        with conn.transaction():
            with conn.cursor() as cur:
                batch = []
                for n, customer in ((2, "bob"), (3, "carol"), (4, "dave")):
                    key = f"python-{run}-{n}"
                    batch.append((key, place_order(cur, topic, key, customer, Decimal(n * 10))))
        for key, oid in batch:
            print(f"committed key={key} outbox_id={oid}")
            committed += 1

        # 3. Rolled back: neither the order nor its event exists afterwards.
        key = f"python-{run}-rolled-back"
        try:
            with conn.transaction():
                with conn.cursor() as cur:
                    place_order(cur, topic, key, "mallory", Decimal("999.99"))
                    raise RuntimeError("payment declined")
        except RuntimeError:
            print(f"rolled_back key={key}")

    print(f"done committed={committed} rolled_back=1 invalid_sqlstate={invalid_sqlstate}")


if __name__ == "__main__":
    main()
