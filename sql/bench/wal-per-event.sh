#!/usr/bin/env bash
# WAL bytes per event over its whole life, by phase, for the first release (0.1.0), the previous
# one and the current one in the same run: 20,000 unkeyed events with a ~90-byte order payload are
# enqueued, claimed 500 at a time (each claim committed before its ack, as a relay does), acked and
# purged, each version in a fresh database after a CHECKPOINT. Prints a markdown table and the
# current version's heaviest WAL record types (pg_walinspect, contrib). Bytes exclude full-page
# images, which depend on where checkpoints fall (other work on the server moves them); the images
# are shown on a line of their own. Run it on a quiet server.
# Usage: sql/bench/wal-per-event.sh [PREVIOUS_VERSION] (after scripts/setup).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/env.sh
n=20000
db=outbox_wal_bench
current=$(psql -X -At -d postgres -c "SELECT default_version FROM pg_available_extensions WHERE name = 'outbox'")
previous=${1:-$(psql -X -At -d postgres -c "SELECT version FROM pg_available_extension_versions
        WHERE name = 'outbox' AND version <> '$current' ORDER BY string_to_array(version, '.')::int[] DESC LIMIT 1")}
trap 'psql -X -q -d postgres -c "DROP DATABASE IF EXISTS $db WITH (FORCE)"' EXIT

measure() { # version -> "enqueue claim+ack purge total" bytes per event, then the record types
  psql -X -q -d postgres -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db"
  psql -X -q -At -v ON_ERROR_STOP=1 -d "$db" <<SQL
SET client_min_messages = warning;
CREATE EXTENSION outbox VERSION '$1';
CREATE EXTENSION pg_walinspect;
CHECKPOINT;
SELECT pg_current_wal_insert_lsn() AS l0 \gset
SELECT count(outbox_enqueue('bench', jsonb_build_object('order_id', g, 'customer', 'c' || (g % 977), 'amount', 42.50)))
  FROM generate_series(1, $n) g \g /dev/null
SELECT pg_current_wal_insert_lsn() AS l1 \gset
DO \$\$
DECLARE ids bigint[]; token bigint;
BEGIN
  LOOP
    SELECT array_agg(c.id), max(c.claim_token) INTO ids, token FROM outbox_claim('wal-bench', 500) c;
    EXIT WHEN ids IS NULL;
    COMMIT;
    PERFORM outbox_ack('wal-bench', token, ids);
    COMMIT;
  END LOOP;
END \$\$;
SELECT pg_current_wal_insert_lsn() AS l2 \gset
SELECT outbox_purge('0 seconds', $n) \g /dev/null
SELECT pg_current_wal_insert_lsn() AS l3 \gset
-- Per phase, without full-page images (they depend on when a checkpoint falls), then the images.
SELECT string_agg(round((w.bytes - w.fpi) / $n)::text, ' ' ORDER BY p.n) || ' '
       || round(sum(w.fpi) / $n)::text
  FROM (VALUES (1, :'l0'::pg_lsn, :'l1'::pg_lsn), (2, :'l1', :'l2'), (3, :'l2', :'l3'), (4, :'l0', :'l3')) p(n, a, b)
  CROSS JOIN LATERAL (SELECT sum(s.combined_size) AS bytes, sum(s.fpi_size) AS fpi
                        FROM pg_get_wal_stats(p.a, p.b, false) s) w
 WHERE p.n <= 4;
SELECT format('| %s | %s | %s |', s."resource_manager/record_type", round(s.count::numeric / $n, 2),
              round((s.combined_size - s.fpi_size)::numeric / $n))
  FROM pg_get_wal_stats(:'l0', :'l3', true) s WHERE s.count > 0 ORDER BY s.combined_size DESC LIMIT 8;
SQL
}

declare -A phases records
for v in 0.1.0 "$previous" "$current"; do
  out=$(measure "$v")
  phases[$v]=$(head -n1 <<<"$out")
  records[$v]=$(tail -n +2 <<<"$out")
done
echo "WAL bytes per event without full-page images ($n events, ~90-byte payload, claims of 500; $(date -u +%F))"
echo
echo "| phase | 0.1.0 | $previous | $current |"
echo "|---|---:|---:|---:|"
i=1
for phase in enqueue "claim + ack" purge "whole life" "full-page images (not above)"; do
  row="| $phase |"
  for v in 0.1.0 "$previous" "$current"; do row+=" $(cut -d' ' -f$i <<<"${phases[$v]}") |"; done
  echo "$row"
  i=$((i + 1))
done
echo
echo "Heaviest WAL record types of $current, per event (without full-page images):"
echo
echo "| record type | records | bytes |"
echo "|---|---:|---:|"
echo "${records[$current]}"
