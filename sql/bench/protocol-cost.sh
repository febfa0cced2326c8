#!/usr/bin/env bash
# What the relay's statements cost the database by how they are sent: backend CPU per pgbench
# transaction (-c 1; see backend-cpu.sh) of the relay's own claim (nothing to claim) and ack
# (nothing held) statements, and of SELECT 1, each sent as a prepared statement (parsed and
# planned once per session), as an unnamed extended-protocol statement (parsed and planned at
# every call: what the relay sends, so that a transaction-mode PgBouncer works) and as a simple
# query. ROUNDS rounds alternate the cases; medians.
# Usage: sql/bench/protocol-cost.sh [TRANSACTIONS [ROUNDS]] (default 4000, 3; after
# scripts/setup). Writes reports/core-1.0/protocol-cost.md with outbox-bench --provenance.
set -euo pipefail
cd "$(dirname "$0")/../.."
tx=${1:-4000}
rounds=${2:-3}
db=outbox_protocol_cost
source sql/bench/backend-cpu.sh

# As outbox-worker/src/store.rs writes them (its schema: public here).
echo "SELECT id, event_id::text AS event_id, topic, event_key, event_type, payload::text AS payload, \
headers::text AS headers, claim_token, retry_count, \
extract(epoch from (clock_timestamp() - created_at))::float8 AS age_at_claim, \
floor(extract(epoch from created_at) * 1000)::int8 AS created_at_ms, ordered \
FROM public.outbox_claim('r', 500);" >"$work/claim.sql"
echo "SELECT id FROM public.outbox_ack_returning('r', 1, '{1,2}') AS id;" >"$work/ack.sql"
echo "SELECT 1;" >"$work/one.sql"
cases=()
for c in claim ack one; do
  for m in prepared extended simple; do cases+=("$c@$m"); done
done

measure_all "" "${cases[@]}"
python3 - "$work" "$tx" "$rounds" <<'PY' | tee reports/core-1.0/protocol-cost.md
import sys
sys.path.insert(0, "sql/bench")
from figures import report, table
runs, med = report("protocol-cost.sh", "What the relay's statements cost by how they are sent",
                   flags="-c 1 -M MODE")
what = {"claim": "the relay's claim statement (`outbox_claim('r', 500)`, nothing to claim)",
        "ack": "the relay's ack statement (`outbox_ack_returning`, nothing held)",
        "one": "`SELECT 1`"}
how = {"prepared": "prepared (`-M prepared`)",
       "extended": "unnamed, extended protocol (`-M extended`, as the relay sends it)",
       "simple": "simple query (`-M simple`)"}
names = {f"{c}@{m}": f"{w}, {h}" for c, w in what.items() for m, h in how.items()}
table(names, runs, med)
saved = sum(med[f"{c}@extended"] - med[f"{c}@prepared"] for c in ("claim", "ack"))
print(f"\nA round (a claim and an ack) would cost {saved:.0f} µs less as prepared statements than as "
      "the unnamed statements the relay sends.")
PY
