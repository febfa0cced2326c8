# Sourced by the sql/bench scripts that measure backend CPU per pgbench transaction (-c 1,
# prepared statements, no TLS, synchronous_commit = off), read from the postmaster's cutime +
# cstime once the session has exited. Needs $db (a scratch database, dropped at exit), $tx and
# $rounds; gives $work (a directory removed at exit) and the functions below.
source scripts/env.sh
load_start=$(cut -d' ' -f1-3 /proc/loadavg)
work=$(mktemp -d)
cleanup() {
  psql -X -q -d postgres -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

postmaster=$(head -1 "$(psql -X -At -d postgres -c 'SHOW data_directory')/postmaster.pid")
children_cpu() { awk '{print $16 + $17}' "/proc/$postmaster/stat"; }

# µs of backend CPU per transaction of $work/CASE.sql, in a fresh database with the extension and
# then SETUP (SQL, may be empty) run in it; a case named CASE@MODE sends it with pgbench -M MODE
# (simple, extended: what a client without prepared statements sends), else -M prepared.
measure() {
  local file=${1%@*} mode=prepared
  [[ $1 == *@* ]] && mode=${1#*@}
  psql -X -q -d postgres -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db" >/dev/null
  psql -X -q -d "$db" -c "CREATE EXTENSION outbox" ${2:+-c "$2"} >/dev/null
  local before after
  before=$(children_cpu)
  PGSSLMODE=disable PGOPTIONS='-c synchronous_commit=off' pgbench -n -M "$mode" -c 1 -t "$tx" -f "$work/$file.sql" "$db" >/dev/null
  sleep 0.3
  after=$(children_cpu)
  echo $(((after - before) * 10000000 / tx / 1000))
}

# Every case named (a $work/CASE.sql) measured $rounds times, the cases alternating, each in a
# fresh database with SETUP: "case µs" lines in $work/figures; the provenance table in
# $work/machine (needs $load_start).
measure_all() {
  local setup=$1 r c
  shift
  for ((r = 1; r <= rounds; r++)); do
    for c in "$@"; do
      echo "$c $(measure "$c" "$setup")" >>"$work/figures"
    done
  done
  "$CARGO_TARGET_DIR/$OUTBOX_PROFILE/outbox-bench" --provenance --load-start "$load_start" >"$work/machine"
}
