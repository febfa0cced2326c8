#!/usr/bin/env bash
# What a producer's transaction costs the database, and the least any function-call enqueue can
# cost: backend CPU per pgbench transaction (see backend-cpu.sh) of an order row alone; with its
# event as a plain INSERT into a copy of outbox_stream (the enqueue benchmark's baseline); with
# the event inserted by a SECURITY DEFINER PL/pgSQL function that does nothing else (the floor of
# an enqueue API that is a function, as outbox_enqueue is); with outbox_enqueue. Keyed events,
# each case in a fresh database, ROUNDS rounds alternating the cases, medians.
# Usage: sql/bench/producer-floor.sh [TRANSACTIONS [ROUNDS]] (default 5000, 3; after
# scripts/setup). Writes reports/core-1.0/producer-floor.md with outbox-bench --provenance.
set -euo pipefail
cd "$(dirname "$0")/../.."
tx=${1:-5000}
rounds=${2:-3}
db=outbox_producer_floor
source sql/bench/backend-cpu.sh

setup="CREATE TABLE bench_order (id bigserial PRIMARY KEY, customer text NOT NULL,
                                  amount numeric(12,2) NOT NULL,
                                  created_at timestamptz NOT NULL DEFAULT now());
       CREATE TABLE bench_event (LIKE outbox_stream INCLUDING ALL);
       CREATE FUNCTION bench_insert_event(topic text, payload jsonb, key text, event_type text)
       RETURNS bigint LANGUAGE plpgsql VOLATILE SECURITY DEFINER
       SET search_path = pg_catalog, pg_temp AS \$\$
       DECLARE new_id bigint;
       BEGIN
           INSERT INTO public.outbox_stream (topic, event_key, key_hash, event_type, payload)
           VALUES (topic, key, public.outbox_key_hash(topic, key), event_type, payload)
           RETURNING id INTO new_id;
           RETURN new_id;
       END \$\$;"
order="INSERT INTO bench_order (customer, amount) VALUES ('customer-1', 10.5);"
payload="'{\"order_id\": 1, \"customer\": \"customer-1\", \"amount\": 10.5}'::jsonb"
key="'order-' || :k"
tx_of() { printf '\\set k random(1, 1000000000)\nBEGIN;\n%s\n%s\nCOMMIT;\n' "$order" "$1" >"$work/$2.sql"; }
tx_of "" order_only
tx_of "INSERT INTO bench_event (topic, event_key, key_hash, event_type, payload, headers) VALUES ('orders', $key, outbox_key_hash('orders', $key), 'OrderCreated', $payload, '{}');" plain
tx_of "SELECT bench_insert_event('orders', $payload, $key, 'OrderCreated');" floor_function
tx_of "SELECT outbox_enqueue('orders', $payload, $key, 'OrderCreated');" enqueue

measure_all "$setup" order_only plain floor_function enqueue
python3 - "$work" "$tx" "$rounds" <<'EOF' | tee reports/core-1.0/producer-floor.md
import sys
sys.path.insert(0, "sql/bench")
from figures import report, table
runs, med = report("producer-floor.sh", "What a producer's transaction costs the database",
                   "; `BEGIN`, an order row, the event (keyed), `COMMIT`")
print("When producers are CPU-bound (16 clients on this machine), their transactions per second "
      "follow the inverse of this cost: the last column is the plain INSERT's cost divided by the "
      "case's, the producer throughput ratio that cost allows.\n")
names = {
    "order_only": "the order row alone",
    "plain": "the event as a plain INSERT into `bench_event` (`LIKE outbox_stream INCLUDING ALL`)",
    "floor_function": "the event inserted into `outbox_stream` by a `SECURITY DEFINER` PL/pgSQL function that does nothing else",
    "enqueue": "the event by `outbox_enqueue`",
}
table(names, runs, med, base="plain")
EOF
