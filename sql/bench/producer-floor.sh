#!/usr/bin/env bash
# What a producer's transaction costs the database, and the least any function-call enqueue can
# cost: backend CPU per pgbench transaction (see backend-cpu.sh) of an order row alone; with its
# event as a plain INSERT into a copy of outbox_stream (the enqueue benchmark's baseline) and into
# outbox_stream itself; inserted by a PL/pgSQL function that does nothing else: plain, SECURITY
# DEFINER, with the pinned search_path, and with both (the floor of an enqueue API that is a
# function, as outbox_enqueue is); with outbox_enqueue. Keyed events, each case in a fresh
# database, ROUNDS rounds alternating the cases, medians.
# Usage: sql/bench/producer-floor.sh [TRANSACTIONS [ROUNDS]] (default 5000, 3; after
# scripts/setup). Writes reports/core-1.0/producer-floor.md with outbox-bench --provenance.
set -euo pipefail
cd "$(dirname "$0")/../.."
tx=${1:-5000}
rounds=${2:-3}
db=outbox_producer_floor
source sql/bench/backend-cpu.sh

# The function that only inserts the event: NAME, ATTRIBUTES.
insert_function() {
  cat <<EOF
CREATE FUNCTION $1(topic text, payload jsonb, key text, event_type text)
RETURNS bigint LANGUAGE plpgsql VOLATILE $2 AS \$\$
DECLARE new_id bigint;
BEGIN
    INSERT INTO public.outbox_stream (topic, event_key, key_hash, event_type, payload)
    VALUES (topic, key, public.outbox_key_hash(topic, key), event_type, payload)
    RETURNING id INTO new_id;
    RETURN new_id;
END \$\$;
EOF
}
pinned="SET search_path = pg_catalog, pg_temp"
setup="CREATE TABLE bench_order (id bigserial PRIMARY KEY, customer text NOT NULL,
                                  amount numeric(12,2) NOT NULL,
                                  created_at timestamptz NOT NULL DEFAULT now());
       CREATE TABLE bench_event (LIKE outbox_stream INCLUDING ALL);
       $(insert_function fn_plain "")
       $(insert_function fn_definer "SECURITY DEFINER")
       $(insert_function fn_pinned "$pinned")
       $(insert_function bench_insert_event "SECURITY DEFINER $pinned")"
order="INSERT INTO bench_order (customer, amount) VALUES ('customer-1', 10.5);"
payload="'{\"order_id\": 1, \"customer\": \"customer-1\", \"amount\": 10.5}'::jsonb"
key="'order-' || :k"
tx_of() { printf '\\set k random(1, 1000000000)\nBEGIN;\n%s\n%s\nCOMMIT;\n' "$order" "$1" >"$work/$2.sql"; }
insert_into() { echo "INSERT INTO $1 (topic, event_key, key_hash, event_type, payload, headers) VALUES ('orders', $key, outbox_key_hash('orders', $key), 'OrderCreated', $payload, '{}');"; }
tx_of "" order_only
tx_of "$(insert_into bench_event)" plain
tx_of "$(insert_into outbox_stream)" plain_stream
for f in fn_plain fn_definer fn_pinned bench_insert_event outbox_enqueue; do
  tx_of "SELECT $f('orders', $payload, $key, 'OrderCreated');" "$f"
done

measure_all "$setup" order_only plain plain_stream fn_plain fn_definer fn_pinned bench_insert_event outbox_enqueue
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
    "plain_stream": "the event as a plain INSERT into `outbox_stream` itself",
    "fn_plain": "the event inserted into `outbox_stream` by a PL/pgSQL function that does nothing else",
    "fn_definer": "the same function, `SECURITY DEFINER`",
    "fn_pinned": "the same function, `SET search_path = pg_catalog, pg_temp`",
    "bench_insert_event": "the same function, `SECURITY DEFINER` and `SET search_path` (as every function of the extension's API)",
    "outbox_enqueue": "the event by `outbox_enqueue`",
}
table(names, runs, med, base="plain")
EOF
