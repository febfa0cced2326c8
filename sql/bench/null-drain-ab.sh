#!/usr/bin/env bash
# Null-sink drain of this checkout's SQL against an earlier release's, on the same server in the
# same run: the SQL-only build of each (scripts/sql-only of that commit), in a database of its
# own, a backlog of EVENTS unkeyed events, drained by one session of
# `outbox_ack(...) FROM outbox_claim('bench', 500)` statements until nothing is left. Versions
# alternate over ROUNDS rounds; events/s and the session's backend CPU per event, medians.
# Usage: sql/bench/null-drain-ab.sh [REV [EVENTS [ROUNDS]]] (default 2af108d = 0.14.0, 100000, 3).
# Writes reports/core-1.0/null-drain-ab.md, with the provenance table of outbox-bench --provenance.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/env.sh
rev=${1:-2af108d}
events=${2:-100000}
rounds=${3:-3}
out=reports/core-1.0/null-drain-ab.md
load_start=$(cut -d' ' -f1-3 /proc/loadavg)
work=$(mktemp -d)
db=outbox_null_drain_ab
cleanup() {
  psql -X -q -d postgres -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true
  git worktree remove --force "$work/old" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

git worktree add --detach -q "$work/old" "$rev"
"$work/old/scripts/sql-only" "$work/old-build" >/dev/null
scripts/sql-only "$work/new-build" >/dev/null
old_sql=$(ls "$work"/old-build/outbox--*.sql | grep -v -- '--.*--')
new_sql=$(ls "$work"/new-build/outbox--*.sql | grep -v -- '--.*--')
old_version=$(basename "$old_sql" .sql | sed 's/outbox--//')
new_version=$(basename "$new_sql" .sql | sed 's/outbox--//')

stat_ticks="SELECT split_part(pg_read_file('/proc/' || pg_backend_pid() || '/stat'), ' ', 14)::bigint
                 + split_part(pg_read_file('/proc/' || pg_backend_pid() || '/stat'), ' ', 15)::bigint"
claim_ack="SELECT outbox_ack('bench', c.claim_token, array_agg(c.id)) FROM outbox_claim('bench', 500) c GROUP BY c.claim_token;"

# run SQL_FILE -> "seconds ticks left": one drain of a fresh backlog
run() {
  psql -X -q -d postgres -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db" >/dev/null
  psql -X -q -v ON_ERROR_STOP=1 -d "$db" -f "$1" >/dev/null
  psql -X -q -v ON_ERROR_STOP=1 -d "$db" -c "SELECT count(outbox_enqueue('bench.order',
      jsonb_build_object('order_id', g, 'amount', 42.50), event_type => 'OrderCreated'))
      FROM generate_series(1, $events) g" -c "VACUUM ANALYZE" -c "CHECKPOINT" >/dev/null
  {
    echo "\\set QUIET on"
    echo "SELECT extract(epoch FROM clock_timestamp()) AS t0, ($stat_ticks) AS c0 \\gset"
    for ((i = 0; i < events / 500 + 2; i++)); do echo "$claim_ack"; done
    echo "SELECT extract(epoch FROM clock_timestamp()) - :t0 AS secs, ($stat_ticks) - :c0 AS ticks \\gset"
    echo "\\echo :secs :ticks"
  } | psql -X -v ON_ERROR_STOP=1 -At -d "$db" | tail -1 | tr '\n' ' '
  psql -X -At -d "$db" -c "SELECT count(*) FROM outbox_event WHERE status <> 'SUCCESS'"
}

results=()
for ((r = 1; r <= rounds; r++)); do
  order=(old new)
  ((r % 2 == 0)) && order=(new old)
  for v in "${order[@]}"; do
    sql=$old_sql
    [[ $v == new ]] && sql=$new_sql
    line=$(run "$sql")
    log "round $r $v: $line (seconds, CPU ticks, events left)"
    results+=("$v $line")
  done
done

machine=$("$CARGO_TARGET_DIR/$OUTBOX_PROFILE/outbox-bench" --provenance --load-start "$load_start")
python3 - "$events" "$old_version ($rev)" "$new_version (this checkout)" "$machine" "${results[@]}" <<'EOF' | tee "$out"
import statistics, sys, os
events = int(sys.argv[1]); names = {"old": sys.argv[2], "new": sys.argv[3]}; machine = sys.argv[4]
runs = {"old": [], "new": []}
for line in sys.argv[5:]:
    v, secs, ticks, left = line.split()
    if int(left) != 0:
        sys.exit(f"{v}: {left} events left after the drain")
    runs[v].append((events / float(secs), int(ticks) * 1e6 / os.sysconf("SC_CLK_TCK") / events))
print("# Null-sink drain: this checkout against an earlier release\n")
print("Written by `sql/bench/null-drain-ab.sh` (see its header for what it runs).\n")
print(machine + "\n")
print(f"Each run: the SQL-only build in a fresh database, {events:,} unkeyed events, one session "
      "draining with `outbox_ack(...) FROM outbox_claim('bench', 500)` (claim and ack in one "
      "statement) until nothing is left; versions alternate, medians of the rounds.\n")
print("| version | rounds | events/s (median) | runs | backend CPU µs/event (median) |")
print("|---|---:|---:|---|---:|")
med = {}
for v in ("old", "new"):
    rate = statistics.median(r[0] for r in runs[v]); cpu = statistics.median(r[1] for r in runs[v])
    med[v] = rate
    print(f"| {names[v]} | {len(runs[v])} | {rate:,.0f} | {', '.join(f'{r[0]:,.0f}' for r in runs[v])} | {cpu:.1f} |")
print(f"\n**{names['new']} drains at {med['new'] / med['old']:.2f}× {names['old']}** "
      "(issue 28's goal: not below the earlier release).")
EOF
