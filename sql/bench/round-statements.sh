#!/usr/bin/env bash
# Where a relay round's database time goes, statement by statement: a throwaway cluster (its own
# port, removed at exit) with pg_stat_statements (track = all, nested statements included); one
# pgbench session enqueues keyed events at RATE per second while another loops as the relay does
# (outbox_wait, outbox_claim, outbox_ack_returning) for SECONDS.
# Usage: sql/bench/round-statements.sh [RATE [SECONDS]] (default 1000, 20; after scripts/setup).
# Writes reports/core-1.0/round-statements.md, with the provenance table of outbox-bench --provenance.
set -euo pipefail
cd "$(dirname "$0")/../.."
rate=${1:-1000}
secs=${2:-20}
source scripts/env.sh
load_start=$(cut -d' ' -f1-3 /proc/loadavg)
bin=$(pg_config --bindir)
work=$(mktemp -d)
chown postgres: "$work"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pg() { sudo -u postgres "$bin/$@"; }
cleanup() {
  pg pg_ctl -D "$work/data" stop -m immediate >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

pg initdb -D "$work/data" -A trust >/dev/null
pg pg_ctl -D "$work/data" -l "$work/log" -w start -o "-c port=$port -c listen_addresses=127.0.0.1 \
  -c unix_socket_directories=$work -c shared_preload_libraries=outbox,pg_stat_statements \
  -c pg_stat_statements.track=all -c pg_stat_statements.max=1000" >/dev/null
export PGHOST=127.0.0.1 PGPORT=$port PGUSER=postgres PGSSLMODE=disable
psql -X -q -d postgres -c "CREATE DATABASE rounds"
psql -X -q -d rounds -c "CREATE EXTENSION outbox" -c "CREATE EXTENSION pg_stat_statements"

echo "SELECT outbox_enqueue('orders', '{\"n\": 1}'::jsonb, 'k' || (random() * 1e9)::bigint, 'OrderCreated');" >"$work/enqueue.sql"
cat >"$work/round.sql" <<'EOF'
SELECT outbox_wait('1 second');
SELECT coalesce(max(claim_token), 0) AS tok, coalesce(array_agg(id), '{}')::text AS ids FROM outbox_claim('r', 20) \gset
SELECT outbox_ack_returning('r', :tok, :ids::bigint[]);
EOF
pgbench -n -M prepared -c 1 -R "$rate" -T $((secs + 3)) -f "$work/enqueue.sql" rounds >/dev/null 2>&1 &
producer=$!
sleep 2
psql -X -q -At -d rounds -c "SELECT pg_stat_statements_reset()" >/dev/null
pgbench -n -M prepared -c 1 -T "$secs" -f "$work/round.sql" rounds >/dev/null
wait "$producer"
"$CARGO_TARGET_DIR/$OUTBOX_PROFILE/outbox-bench" --provenance --load-start "$load_start" >"$work/machine"

{
  echo "# Where a relay round's database time goes"
  echo
  echo "Written by \`sql/bench/round-statements.sh $rate $secs\`: a throwaway cluster with"
  echo "\`pg_stat_statements.track = all\`; one pgbench session enqueues keyed events at $rate/s, another"
  echo "loops as the relay does (\`outbox_wait\`, \`outbox_claim('r', 20)\`, \`outbox_ack_returning\`) for"
  echo "$secs s. Times are wall time inside the server, nested statements counted in their callers too,"
  echo "and include pg_stat_statements' own overhead; \`outbox_wait\`'s is mostly waiting."
  echo
  cat "$work/machine"
  echo
  psql -X -q -At -d rounds -F '|' -c "
    WITH r AS (SELECT calls AS rounds FROM pg_stat_statements WHERE query LIKE '%FROM outbox_claim(%' AND toplevel)
    SELECT format('%s rounds acked %s events: %s events per round.', r.rounds, e.acked,
                  round(e.acked::numeric / r.rounds, 2))
      FROM r, (SELECT count(*) AS acked FROM outbox_event WHERE status = 'SUCCESS') e"
  echo
  echo "| µs per round | µs per call | calls per round | top level | statement |"
  echo "|---:|---:|---:|---|---|"
  psql -X -q -At -d rounds -F '|' -c "
    WITH r AS (SELECT calls AS rounds FROM pg_stat_statements WHERE query LIKE '%FROM outbox_claim(%' AND toplevel)
    SELECT '| ' || round((s.total_exec_time * 1000 / r.rounds)::numeric, 1) || ' | '
           || round((s.total_exec_time * 1000 / s.calls)::numeric, 1) || ' | '
           || round(s.calls::numeric / r.rounds, 2) || ' | ' || CASE WHEN s.toplevel THEN 'yes' ELSE '' END
           || ' | \`' || replace(left(regexp_replace(s.query, '\s+', ' ', 'g'), 90), '|', '\|') || '\` |'
      FROM pg_stat_statements s, r
     WHERE s.query NOT LIKE '%pg_stat_statements%'
     ORDER BY s.total_exec_time DESC
     LIMIT 30"
} | tee reports/core-1.0/round-statements.md
