# Sourced by the benches that measure under a held snapshot (claim-breakdown.sh).
# hold_snapshot DB: a background session of DB opens a REPEATABLE READ
# transaction and reads something, which takes its snapshot, then sleeps until it is killed; sets
# `holder` to its pid and returns once the server shows the snapshot (the session's backend_xmin).
hold_snapshot() {
  local db=$1
  psql -X -q -d "$db" -c "BEGIN ISOLATION LEVEL REPEATABLE READ" -c "SELECT count(*) FROM pg_class" \
    -c "SELECT pg_sleep(3600)" >/dev/null 2>&1 &
  holder=$!
  until [[ $(psql -X -A -t -d "$db" -c "SELECT count(*) FROM pg_stat_activity
                WHERE datname = current_database() AND backend_xmin IS NOT NULL
                  AND query LIKE 'SELECT pg_sleep%'") == 1 ]]; do sleep 0.1; done
}
