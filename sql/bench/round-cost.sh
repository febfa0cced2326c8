#!/usr/bin/env bash
# What one relay round costs the database: backend CPU per pgbench transaction (-c 1, prepared
# statements), read from the postmaster's cutime + cstime once the session has exited. Cases, each
# in a fresh database: three keyed enqueues; the same plus a claim and the ack of what it took (the
# difference is a round of 3 events); an empty claim; an ack of ids not held; as controls, the
# same round on a one-table queue (claim: one UPDATE ... RETURNING, ack: one UPDATE) and two
# transactions that do nothing. ROUNDS rounds alternate the cases; medians.
# Usage: sql/bench/round-cost.sh [TRANSACTIONS [ROUNDS]]
# (default 3000, 3; after scripts/setup). Writes reports/core-1.0/round-cost.md, with the
# provenance table of outbox-bench --provenance.
set -euo pipefail
cd "$(dirname "$0")/../.."
tx=${1:-3000}
rounds=${2:-3}
db=outbox_round_cost
source sql/bench/backend-cpu.sh

enqueue="SELECT outbox_enqueue('orders', '{\"n\": 1}'::jsonb, 'k' || (random() * 1e9)::bigint, 'OrderCreated');"
printf '%s\n%s\n%s\n' "$enqueue" "$enqueue" "$enqueue" >"$work/enqueue3.sql"
{
  cat "$work/enqueue3.sql"
  echo "SELECT claim_token AS tok, array_agg(id)::text AS ids FROM outbox_claim('r', 10) GROUP BY 1 \gset"
  echo "SELECT outbox_ack('r', :tok, :ids::bigint[]);"
} >"$work/round3.sql"
echo "SELECT count(*) FROM outbox_claim('r', 10);" >"$work/empty_claim.sql"
# The control: the shape 0.1.0 had, one table whose status column says where an event is.
queue="CREATE TABLE queue (id bigserial PRIMARY KEY, topic text NOT NULL, event_key text, event_type text,
  payload jsonb NOT NULL, status smallint NOT NULL DEFAULT 0, claim_owner text, claim_token bigint,
  claimed_at timestamptz); CREATE INDEX queue_waiting ON queue (id) WHERE status = 0; CREATE SEQUENCE queue_token;"
insert="INSERT INTO queue (topic, event_key, event_type, payload) VALUES ('orders', 'k' || (random() * 1e9)::bigint, 'OrderCreated', '{\"n\": 1}'::jsonb);"
printf '%s\n%s\n%s\n' "$insert" "$insert" "$insert" >"$work/insert3.sql"
{
  cat "$work/insert3.sql"
  echo "WITH c AS (UPDATE queue SET status = 1, claim_owner = 'r', claim_token = (SELECT nextval('queue_token')), claimed_at = clock_timestamp() WHERE id IN (SELECT id FROM queue WHERE status = 0 ORDER BY id LIMIT 10 FOR UPDATE SKIP LOCKED) RETURNING id, claim_token) SELECT max(claim_token) AS tok, array_agg(id)::text AS ids FROM c \gset"
  echo "UPDATE queue SET status = 2 WHERE id = ANY (:ids::bigint[]) AND claim_owner = 'r' AND claim_token = :tok AND status = 1;"
} >"$work/queue_round3.sql"
printf 'SELECT 1;\nSELECT 1;\n' >"$work/two_empty.sql"
echo "SELECT outbox_ack('r', 1, '{1,2,3}');" >"$work/empty_ack.sql"

measure_all "$queue" enqueue3 round3 empty_claim empty_ack insert3 queue_round3 two_empty
python3 - "$work" "$tx" "$rounds" <<'EOF' | tee reports/core-1.0/round-cost.md
import sys
sys.path.insert(0, "sql/bench")
from figures import report, table
runs, med = report("round-cost.sh", "What one relay round costs the database")
names = {
    "enqueue3": "three keyed `outbox_enqueue` calls",
    "round3": "the same, then `outbox_claim('r', 10)` and `outbox_ack` of what it took",
    "empty_claim": "`outbox_claim('r', 10)` with nothing to claim",
    "empty_ack": "`outbox_ack('r', 1, '{1,2,3}')`, nothing held",
    "insert3": "control: three INSERTs into a one-table queue",
    "queue_round3": "control: the same, then a claim (one `UPDATE … RETURNING`, `SKIP LOCKED`) and an ack (one `UPDATE`)",
    "two_empty": "control: two transactions of `SELECT 1`",
}
table(names, runs, med)
outbox, queue = med["round3"] - med["enqueue3"], med["queue_round3"] - med["insert3"]
print(f"\nA round of 3 events (claim + ack): {outbox:.0f} µs; on the one-table queue {queue:.0f} µs; "
      f"two transactions that do nothing {med['two_empty']:.0f} µs. Per event: {outbox / 3:.0f}, "
      f"{queue / 3:.0f} and {med['two_empty'] / 3:.0f} µs.")
EOF
