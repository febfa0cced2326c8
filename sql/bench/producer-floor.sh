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
source scripts/env.sh
tx=${1:-5000}
rounds=${2:-3}
out=reports/core-1.0/producer-floor.md
load_start=$(cut -d' ' -f1-3 /proc/loadavg)
db=outbox_producer_floor
work=$(mktemp -d)
cleanup() {
  psql -X -q -d postgres -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
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

cases=(order_only plain floor_function enqueue)
for ((r = 1; r <= rounds; r++)); do
  for c in "${cases[@]}"; do
    echo "$c $(measure "$c" "$setup")" >>"$work/figures"
  done
done

machine=$("$CARGO_TARGET_DIR/$OUTBOX_PROFILE/outbox-bench" --provenance --load-start "$load_start")
python3 - "$work/figures" "$machine" "$tx" "$rounds" <<'EOF' | tee "$out"
import statistics, sys
path, machine, tx, rounds = sys.argv[1:]
runs = {}
for line in open(path):
    case, us = line.split()
    runs.setdefault(case, []).append(int(us))
med = {c: statistics.median(v) for c, v in runs.items()}
print("# What a producer's transaction costs the database\n")
print(f"Written by `sql/bench/producer-floor.sh {tx} {rounds}`: backend CPU per pgbench transaction "
      "(`-c 1 -M prepared`, no TLS, `synchronous_commit = off`; `BEGIN`, an order row, the event "
      "(keyed), `COMMIT`), from the postmaster's cutime + cstime after the session exited; each case "
      f"in a fresh database, the cases alternating, medians of {rounds} rounds of {tx} transactions. "
      "When producers are CPU-bound (16 clients on this machine), their transactions per second "
      "follow the inverse of this cost: the last column is the plain INSERT's cost divided by the "
      "case's, the producer throughput ratio that cost allows.\n")
print(machine + "\n")
print("| case | µs per transaction (median) | plain ÷ case | runs |\n|---|---:|---:|---|")
names = {
    "order_only": "the order row alone",
    "plain": "the event as a plain INSERT into `bench_event` (`LIKE outbox_stream INCLUDING ALL`)",
    "floor_function": "the event inserted into `outbox_stream` by a `SECURITY DEFINER` PL/pgSQL function that does nothing else",
    "enqueue": "the event by `outbox_enqueue`",
}
for c, name in names.items():
    print(f"| {name} | {med[c]:.0f} | {med['plain'] / med[c]:.2f} | {', '.join(map(str, runs[c]))} |")
EOF
