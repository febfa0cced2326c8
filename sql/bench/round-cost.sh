#!/usr/bin/env bash
# What one relay round costs the database: backend CPU per pgbench transaction (-c 1, prepared
# statements), read from the postmaster's cutime + cstime once the session has exited. Cases, each
# in a fresh database: three keyed enqueues; the same plus a claim and the ack of what it took (the
# difference is a round of 3 events); an empty claim; an ack of ids not held. ROUNDS rounds
# alternate the cases; medians. Usage: sql/bench/round-cost.sh [TRANSACTIONS [ROUNDS]]
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
echo "SELECT outbox_ack('r', 1, '{1,2,3}');" >"$work/empty_ack.sql"

measure_all "" enqueue3 round3 empty_claim empty_ack
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
}
table(names, runs, med)
print(f"\nA round of 3 events (claim + ack): {med['round3'] - med['enqueue3']:.0f} µs.")
EOF
