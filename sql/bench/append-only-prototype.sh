#!/usr/bin/env bash
# Prototype of docs/design-append-only.md in plain SQL, measured against today's model in the same
# run. Not the extension: an experiment that turns the note's "expected cost" into figures.
#
# What it builds (schema `proto` of a scratch database):
#   event_data  insert-only event rows; txid = pg_current_xact_id(); only the PK and (txid, id) index
#   cursor      one row: two pg_snapshots (prev, cur) and a position (pos_txid, pos_id)
#   batch       one row per claim: token, owner, claimed_at, pending bigint[]
#   claim()     PgQ's batch rule: lock the cursor row (FOR UPDATE SKIP LOCKED), hand out up to max
#               events whose txid is visible in cur and not in prev, in (txid, id) order from the
#               position; rotate (prev := cur, cur := pg_current_snapshot()) when that set is used
#               up. Prev's in-progress txids are looked up by equality and the rest read as a range
#               from xmax(prev) (PgQ's trick); claim(owner, max, true) reads the note's literal
#               range from xmin(prev) instead, for comparison only.
#   ack()       removes ids from the batch's pending array; deletes the batch once it is empty
# Left out on purpose: retries (nack, release, reclaim, outbox_retry), keys and per-key order,
# leases, the outbox_event view, real partitions. Every event here is an unordered event.
#
# What it prints:
#   1. Correctness (PASS/FAIL lines, exit 1 on any FAIL): (a) an event whose transaction took its
#      txid before later events but commits after claims have passed them is claimed exactly
#      once; (b) every event of three concurrent producers (commits out of txid order, rollbacks,
#      subtransactions) is claimed exactly once: none twice, none lost; (c) two concurrent
#      claimers never get the same event.
#   2. WAL bytes per event, between pg_current_wal_insert_lsn() positions taken around each phase:
#      the records of the model's database (pg_walinspect; this server also runs the test suite),
#      their full-page-image part, and the raw server-wide distance of the life. The phases are
#      enqueue (one event per transaction), claim + ack (claims of BATCH, each call committed)
#      and retention (prototype: TRUNCATE, which costs what dropping a partition costs; today:
#      outbox_purge until it returns 0). Each model starts after a CHECKPOINT. Today's model is
#      CREATE EXTENSION outbox (default version) and VERSION '0.1.0', each in its own database.
#   3. Server-side drain rate: EVENTS due events drained by one session with claim BATCH + ack in
#      a PL/pgSQL loop, each call committed (as sql/bench/drain-ab.sh); best of 3. Also what the
#      single cursor costs: claim(10) + ack cycles per second (synchronous_commit on and off)
#      and the WAL of one poll that finds nothing.
#   4. Held snapshot: another session holds a REPEATABLE READ snapshot while EVENTS events are
#      enqueued, claimed and acked in rounds of EVENTS/10. Per round: the shared buffers and ms of
#      the round's first claim (EXPLAIN (ANALYZE, BUFFERS), which counts the function's own
#      statements) and the mean time of the other claims, prototype against today's model. Then
#      2,000 claims of 5 events under the same snapshot (the cursor gains one version per
#      claim). Then a held WRITING transaction (one with an xid: it holds back every snapshot's
#      xmin), with the default claim and with the note's literal range.
#
# Usage: sql/bench/append-only-prototype.sh [EVENTS] [BATCH]   (defaults 100000 500; ~3 minutes)
# Needs the PostgreSQL 15 server of scripts/setup with the outbox extension installed, and
# pg_walinspect (contrib) for the FPI column. Uses the scratch databases proto_ao, proto_ao_cur
# and proto_ao_v010, dropped on exit. Writes no file. Section 3's rates move a lot on a loaded
# machine: compare models within one run.
set -euo pipefail
export PGHOST=${PGHOST:-127.0.0.1} PGPORT=${PGPORT:-5432} PGUSER=${PGUSER:-postgres}
events=${1:-100000} batch=${2:-500}
round=$((events / 10))
dbs=(proto_ao proto_ao_cur proto_ao_v010)
failed=0

q() { psql -X -q -At -v ON_ERROR_STOP=1 "$@"; }
# Runs SQL (stdin) in a database; prints what it RAISEs as NOTICE, nothing else.
notices() { q -d "$1" 2>&1 >/dev/null | sed -nE 's/^NOTICE: +//p; /ERROR|FATAL/w /dev/stderr'; }
pass() { echo "PASS  $*"; }
fail() { echo "FAIL  $*"; failed=1; }
check() { # condition-as-0/1 message
  if [ "$1" = 1 ]; then pass "$2"; else fail "$2"; fi
}

bg_pids=()
cleanup() {
  for p in "${bg_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for db in "${dbs[@]}"; do q -d postgres -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" 2>/dev/null || true; done
}
trap cleanup EXIT

for _ in $(seq 40); do pg_isready -q && break; echo "waiting for the server at $PGHOST:$PGPORT" >&2; sleep 30; done
current=$(q -d postgres -c "SELECT default_version FROM pg_available_extensions WHERE name = 'outbox'")
[ -n "$current" ] || { echo "the outbox extension is not installed on this server" >&2; exit 2; }

for db in "${dbs[@]}"; do
  q -d postgres -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db"
done
q -d proto_ao_cur -c "CREATE EXTENSION outbox"
q -d proto_ao_v010 -c "CREATE EXTENSION outbox VERSION '0.1.0'"
walinspect=1
q -d proto_ao -c "CREATE EXTENSION pg_walinspect" 2>/dev/null || walinspect=0

# ---------------------------------------------------------------------------------------------
# The prototype.
q -d proto_ao <<'SQL'
CREATE SCHEMA proto;

-- Inserted once, never updated: neither index ever holds a dead entry between retentions.
-- event_type and headers are kept (the design lists them) so rows compare with outbox_event's.
CREATE TABLE proto.event_data (
    id         bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    event_id   uuid NOT NULL DEFAULT gen_random_uuid(),
    -- The top-level transaction's id, drawn at its first write (not at commit): the cursor's
    -- snapshots decide from it whether the event's transaction has finished.
    txid       xid8 NOT NULL DEFAULT pg_current_xact_id(),
    topic      text NOT NULL,
    event_key  text,
    event_type text,
    payload    jsonb NOT NULL,
    headers    jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX event_data_txid_id_idx ON proto.event_data (txid, id);

-- The window being handed out is visible(cur_snap) minus visible(prev_snap); (pos_txid, pos_id)
-- is the last event handed out from it, (0, 0) right after a rotation.
CREATE TABLE proto.cursor (
    one       boolean PRIMARY KEY DEFAULT true CHECK (one),
    prev_snap pg_snapshot NOT NULL,
    cur_snap  pg_snapshot NOT NULL,
    pos_txid  xid8 NOT NULL DEFAULT '0',
    pos_id    bigint NOT NULL DEFAULT 0
);
-- prev = cur: the first window is empty, the first claim rotates. Events of transactions that
-- finished before this snapshot would never be handed out (none exist yet).
INSERT INTO proto.cursor (prev_snap, cur_snap) VALUES (pg_current_snapshot(), pg_current_snapshot());

CREATE SEQUENCE proto.batch_token_seq;
CREATE TABLE proto.batch (
    token      bigint PRIMARY KEY DEFAULT nextval('proto.batch_token_seq'),
    owner      text NOT NULL,
    claimed_at timestamptz NOT NULL,
    pending    bigint[] NOT NULL
);

-- Back to an empty outbox with the cursor at "now" (between experiments).
CREATE FUNCTION proto.reset() RETURNS void LANGUAGE sql AS $$
    TRUNCATE proto.event_data, proto.batch;
    UPDATE proto.cursor SET prev_snap = pg_current_snapshot(), cur_snap = pg_current_snapshot(),
                            pos_txid = '0', pos_id = 0;
$$;

-- p_naive: the design note's literal range, txid from xmin(prev) filtered by both snapshots (only
-- for the held-writer comparison of section 4); the default reads prev's in-progress txids by
-- equality and the rest from xmax(prev).
CREATE FUNCTION proto.claim(p_owner text, p_max int, p_naive boolean DEFAULT false)
RETURNS TABLE (token bigint, id bigint, event_id uuid, txid xid8, topic text, event_key text,
               event_type text, payload jsonb, headers jsonb, created_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    c proto.cursor%ROWTYPE;
    kept proto.cursor%ROWTYPE;
    c0 text;
    -- Only the keys travel through the function (arrays of whole rows cost ~10 us per row);
    -- the rows are read once, at the end, by primary key.
    ids bigint[] := '{}';
    before_rotation int;
    part_ids bigint[];
    part_txids xid8[];
    x xid8;
    fresh pg_snapshot;
    lo_txid xid8;
    lo_id bigint;
    tok bigint;
BEGIN
    -- Each statement below must see a newer snapshot than the one before (READ COMMITTED):
    -- under REPEATABLE READ the fresh snapshot would never advance.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'proto.claim: must run at READ COMMITTED';
    END IF;
    -- One claimer at a time owns the cursor; the others get nothing now (they would serve
    -- retries in the real design). Locking follows the update chain: we read the latest cursor.
    SELECT * INTO c FROM proto.cursor FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN RETURN; END IF;
    c0 := c::text;
    FOR w IN 1..2 LOOP
        -- Part 1: transactions in progress at prev that cur sees finished. They are below
        -- xmax(prev) but found by equality on txid, so a long transaction that holds back
        -- xmin(prev) does not make every claim re-read the range from xmin (PgQ does the same:
        -- an explicit list for the in-progress ones, a range from xmax(prev) for the rest).
        IF NOT p_naive AND c.pos_txid < pg_snapshot_xmax(c.prev_snap) THEN
            FOR x IN SELECT t FROM pg_snapshot_xip(c.prev_snap) t
                      WHERE t >= c.pos_txid AND pg_visible_in_snapshot(t, c.cur_snap)
                      ORDER BY t LOOP
                EXIT WHEN cardinality(ids) >= p_max;
                -- Equality on txid plus id > pos: the index starts at the position, not at the
                -- transaction's first event (a big late transaction is not re-walked per claim).
                SELECT array_agg(e.id) INTO part_ids
                  FROM (SELECT e.id FROM proto.event_data e
                         WHERE e.txid = x AND e.id > CASE WHEN x = c.pos_txid THEN c.pos_id ELSE 0 END
                         ORDER BY e.id LIMIT p_max - cardinality(ids)) e;
                IF part_ids IS NOT NULL THEN
                    ids := ids || part_ids;
                    c.pos_txid := x; c.pos_id := part_ids[cardinality(part_ids)];
                END IF;
            END LOOP;
        END IF;
        -- Part 2: one index range from the position, or from xmax(prev) (naive: xmin(prev)), to
        -- xmax(cur), keeping what cur sees finished (naive: and prev does not). Entries of
        -- transactions cur saw in progress are read and skipped until the window rotates.
        IF cardinality(ids) < p_max THEN
            lo_txid := CASE WHEN p_naive THEN pg_snapshot_xmin(c.prev_snap) ELSE pg_snapshot_xmax(c.prev_snap) END;
            lo_id := 0;
            IF (c.pos_txid, c.pos_id) >= (lo_txid, lo_id) THEN
                lo_txid := c.pos_txid; lo_id := c.pos_id;
            END IF;
            SELECT array_agg(e.id), array_agg(e.txid) INTO part_ids, part_txids
              FROM (SELECT e.id, e.txid FROM proto.event_data e
                     WHERE (e.txid, e.id) > (lo_txid, lo_id)
                       AND e.txid < pg_snapshot_xmax(c.cur_snap)
                       AND pg_visible_in_snapshot(e.txid, c.cur_snap)
                       AND NOT (p_naive AND pg_visible_in_snapshot(e.txid, c.prev_snap))
                     ORDER BY e.txid, e.id LIMIT p_max - cardinality(ids)) e;
            IF part_ids IS NOT NULL THEN
                ids := ids || part_ids;
                c.pos_txid := part_txids[cardinality(part_txids)];
                c.pos_id := part_ids[cardinality(part_ids)];
            END IF;
        END IF;
        EXIT WHEN cardinality(ids) >= p_max OR w = 2;
        -- The window is used up: rotate (prev := cur, cur := now).
        fresh := pg_current_snapshot();
        EXIT WHEN fresh::text = c.cur_snap::text;
        kept := c; before_rotation := cardinality(ids);
        c.prev_snap := c.cur_snap; c.cur_snap := fresh; c.pos_txid := '0'; c.pos_id := 0;
    END LOOP;
    -- A rotation whose window held no event is not kept: the next window, from the same cur,
    -- covers it. So a poll of an idle outbox writes no cursor version.
    IF cardinality(ids) = before_rotation THEN c := kept; END IF;
    IF c::text <> c0 THEN
        UPDATE proto.cursor SET prev_snap = c.prev_snap, cur_snap = c.cur_snap,
                                pos_txid = c.pos_txid, pos_id = c.pos_id;
    END IF;
    IF cardinality(ids) = 0 THEN RETURN; END IF;
    INSERT INTO proto.batch (owner, claimed_at, pending) VALUES (p_owner, clock_timestamp(), ids)
    RETURNING proto.batch.token INTO tok;
    RETURN QUERY SELECT tok, e.id, e.event_id, e.txid, e.topic, e.event_key, e.event_type,
                        e.payload, e.headers, e.created_at
                   FROM proto.event_data e WHERE e.id = ANY (ids) ORDER BY e.txid, e.id;
END
$$;

-- Returns how many ids the batch still waits for (0: settled and deleted), NULL if the owner
-- holds no such batch.
CREATE FUNCTION proto.ack(p_owner text, p_token bigint, p_ids bigint[]) RETURNS int
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    rest int;
BEGIN
    -- The usual case, an ack of the whole batch: one DELETE, no new row version.
    DELETE FROM proto.batch b
     WHERE b.token = p_token AND b.owner = p_owner
       AND NOT EXISTS (SELECT unnest(b.pending) EXCEPT SELECT unnest(p_ids));
    IF FOUND THEN RETURN 0; END IF;
    -- A partial ack rewrites the whole array (one datum): k partial acks of a batch cost k copies.
    UPDATE proto.batch b
       SET pending = ARRAY(SELECT unnest(b.pending) EXCEPT SELECT unnest(p_ids) ORDER BY 1)
     WHERE b.token = p_token AND b.owner = p_owner AND b.pending && p_ids
    RETURNING cardinality(b.pending) INTO rest;
    IF rest = 0 THEN DELETE FROM proto.batch b WHERE b.token = p_token; END IF;
    RETURN rest;
END
$$;

-- The correctness checks' log: every event a claim returned, written in the claim's transaction.
CREATE SCHEMA chk;
CREATE TABLE chk.claimed (seq bigserial, claimer text, token bigint, id bigint, txid xid8,
                          at timestamptz DEFAULT clock_timestamp());
CREATE TABLE chk.flag (done boolean);
SQL

# One claim + ack cycle of claimer $1 (max $2) as PL/pgSQL, logging what it got; sets `ids`.
claim_logged() {
  cat <<SQL
    WITH c AS (SELECT * FROM proto.claim('$1', $2)),
         l AS (INSERT INTO chk.claimed (claimer, token, id, txid) SELECT '$1', c.token, c.id, c.txid FROM c)
    SELECT max(c.token), array_agg(c.id) INTO tok, ids FROM c;
    COMMIT;
    IF ids IS NOT NULL THEN PERFORM proto.ack('$1', tok, ids); COMMIT; END IF;
SQL
}

# ---------------------------------------------------------------------------------------------
echo "== 1. correctness of the prototype's claim"

# (a) The late committer: it draws its txid first, then sleeps 3 s before committing, while a
# loop enqueues later events (higher txid and id), claims and acks them.
q -d proto_ao -c "SELECT proto.reset()" -c "TRUNCATE chk.claimed" >/dev/null
PGAPPNAME=proto_ao_late q -d proto_ao -c "BEGIN" \
  -c "INSERT INTO proto.event_data (topic, payload) VALUES ('late', '{}')" \
  -c "SELECT pg_sleep(3)" -c "COMMIT" >/dev/null &
late_pid=$!; bg_pids+=("$late_pid")
until [ "$(q -d proto_ao -c "SELECT count(*) FROM pg_stat_activity
             WHERE application_name = 'proto_ao_late' AND backend_xid IS NOT NULL")" = 1 ]; do sleep 0.1; done
q -d proto_ao <<SQL
SET statement_timeout = '60s';
DO \$\$
DECLARE tok bigint; ids bigint[]; after_late int := 0;
BEGIN
  FOR i IN 1..600 LOOP
    INSERT INTO proto.event_data (topic, payload) SELECT 'early', '{}' FROM generate_series(1, 5);
    COMMIT;
$(claim_logged fg 7)
    -- Go on 20 rounds past the late event, so a second hand-out would show.
    IF EXISTS (SELECT 1 FROM chk.claimed l JOIN proto.event_data e USING (id) WHERE e.topic = 'late') THEN
      after_late := after_late + 1;
    END IF;
    EXIT WHEN after_late > 20;
    PERFORM pg_sleep(0.02);
  END LOOP;
  -- What is left (the last window): drained, so "none skipped" can be checked.
  FOR i IN 1..3 LOOP
$(claim_logged final 500)
  END LOOP;
END \$\$;
SQL
wait "$late_pid"
read -r late_n passed_n dups left <<<"$(q -d proto_ao -F ' ' -c "
  WITH late AS (SELECT id, txid FROM proto.event_data WHERE topic = 'late'),
       late_claim AS (SELECT min(seq) AS seq FROM chk.claimed WHERE id = (SELECT id FROM late))
  SELECT (SELECT count(*) FROM chk.claimed WHERE id = (SELECT id FROM late)),
         (SELECT count(*) FROM chk.claimed l WHERE l.seq < (SELECT seq FROM late_claim)
             AND l.id > (SELECT id FROM late) AND l.txid > (SELECT txid FROM late)),
         (SELECT count(*) - count(DISTINCT id) FROM chk.claimed),
         (SELECT count(*) FROM proto.event_data e WHERE NOT EXISTS (SELECT 1 FROM chk.claimed l WHERE l.id = e.id))")"
check "$([ "$passed_n" -gt 0 ] && echo 1)" "(a) claims handed out $passed_n later events (higher txid and id) while the late transaction was open"
check "$([ "$late_n" = 1 ] && echo 1)" "(a) the late event was claimed exactly once, after its commit (claimed $late_n times)"
check "$([ "$dups" = 0 ] && [ "$left" = 0 ] && echo 1)" "(a) no event of that run claimed twice ($dups) or never ($left)"

# (b), (c): three producers (random delays before commit so commits come out of txid order, one
# with a rollback every 10th transaction and one with subtransactions) while two claimers drain.
q -d proto_ao -c "SELECT proto.reset()" -c "TRUNCATE chk.claimed, chk.flag" >/dev/null
producer() { # n max_sleep_s
  cat <<SQL
SET statement_timeout = '120s';
DO \$\$
BEGIN
  FOR t IN 1..100 LOOP
    IF $1 = 3 AND t % 5 = 0 THEN
      BEGIN -- a subtransaction: the row's xmin is a subxid, txid the top-level one
        INSERT INTO proto.event_data (topic, payload)
        SELECT 'chk', jsonb_build_object('p', $1, 't', t, 'g', g) FROM generate_series(1, 20) g;
      EXCEPTION WHEN OTHERS THEN RAISE;
      END;
    ELSE
      INSERT INTO proto.event_data (topic, payload)
      SELECT 'chk', jsonb_build_object('p', $1, 't', t, 'g', g) FROM generate_series(1, 20) g;
    END IF;
    PERFORM pg_sleep(random() * $2);
    IF $1 = 2 AND t % 10 = 0 THEN ROLLBACK; ELSE COMMIT; END IF;
  END LOOP;
END \$\$;
SQL
}
claimer() { # name
  cat <<SQL
SET statement_timeout = '120s';
DO \$\$
DECLARE tok bigint; ids bigint[]; idle int := 0;
BEGIN
  LOOP
$(claim_logged "$1" 50)
    IF ids IS NULL THEN
      idle := idle + 1;
      EXIT WHEN idle > 20 AND EXISTS (SELECT 1 FROM chk.flag);
      PERFORM pg_sleep(0.005);
    ELSE
      idle := 0;
    END IF;
  END LOOP;
END \$\$;
SQL
}
claimer c1 | q -d proto_ao & c1=$!
claimer c2 | q -d proto_ao & c2=$!
producer 1 0.01 | q -d proto_ao & p1=$!
producer 2 0.02 | q -d proto_ao & p2=$!
producer 3 0.05 | q -d proto_ao & p3=$!
bg_pids+=("$c1" "$c2" "$p1" "$p2" "$p3")
wait "$p1" "$p2" "$p3"
q -d proto_ao -c "INSERT INTO chk.flag VALUES (true)"
wait "$c1" "$c2"
# Whatever the claimers left (they stop after 20 empty claims): drained here, logged as 'final'.
q -d proto_ao <<SQL
DO \$\$
DECLARE tok bigint; ids bigint[];
BEGIN
  FOR i IN 1..3 LOOP
$(claim_logged final 500)
  END LOOP;
END \$\$;
SQL
read -r produced claimed distinct_n lost phantom by1 by2 both open_batches behind <<<"$(q -d proto_ao -F ' ' -c "
  SELECT (SELECT count(*) FROM proto.event_data),
         (SELECT count(*) FROM chk.claimed), (SELECT count(DISTINCT id) FROM chk.claimed),
         (SELECT count(*) FROM proto.event_data e WHERE NOT EXISTS (SELECT 1 FROM chk.claimed l WHERE l.id = e.id)),
         (SELECT count(*) FROM chk.claimed l WHERE NOT EXISTS (SELECT 1 FROM proto.event_data e WHERE e.id = l.id)),
         (SELECT count(*) FROM chk.claimed WHERE claimer = 'c1'),
         (SELECT count(*) FROM chk.claimed WHERE claimer = 'c2'),
         (SELECT count(*) FROM (SELECT id FROM chk.claimed GROUP BY id HAVING count(DISTINCT claimer) > 1) s),
         (SELECT count(*) FROM proto.batch),
         -- Hand-outs below a txid handed out before: commits out of txid order, found by part 1.
         (SELECT count(*) FROM (SELECT txid::text::bigint AS t, max(txid::text::bigint) OVER
                 (ORDER BY seq ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS m FROM chk.claimed) s
           WHERE t < m)")"
check "$([ "$produced" = 5800 ] && echo 1)" "(b) the producers committed $produced events (3 x 100 transactions of 20, less the 10 that rolled back: 5800)"
check "$([ "$claimed" = "$distinct_n" ] && echo 1)" "(b) no event claimed twice ($claimed claims of $distinct_n distinct events)"
check "$([ "$lost" = 0 ] && [ "$phantom" = 0 ] && echo 1)" "(b) none lost ($lost never claimed) and none from a rolled-back transaction ($phantom)"
check "$([ "$by1" -gt 0 ] && [ "$by2" -gt 0 ] && [ "$both" = 0 ] && echo 1)" \
  "(c) concurrent claimers c1 ($by1 events) and c2 ($by2) never got the same event ($both shared)"
check "$([ "$open_batches" = 0 ] && echo 1)" "(b) every batch settled by its ack ($open_batches left)"
check "$([ "$behind" -gt 0 ] && echo 1)" "(b) $behind events were handed out after a higher txid (they committed out of txid order)"

# ---------------------------------------------------------------------------------------------
# The models, as SQL snippets: (P)rototype, (N) the prototype with the note's literal range
# (section 4 only), today's (C)urrent default version, (V) 0.1.0.
payload="jsonb_build_object('order_id', g, 'customer', 'c' || (g % 977), 'amount', 42.50)"
declare -A dbof=([P]=proto_ao [N]=proto_ao [C]=proto_ao_cur [V]=proto_ao_v010)
declare -A label=([P]="prototype" [C]="outbox $current" [V]="outbox 0.1.0")
proto() { [[ $1 == [PN] ]]; }
enqueue_sql() { # model topic lo hi -> events g in [lo, hi], one statement
  if proto "$1"; then
    echo "INSERT INTO proto.event_data (topic, event_type, payload) SELECT '$2', 'OrderCreated', $payload FROM generate_series($3, $4) g"
  else
    echo "PERFORM count(outbox_enqueue('$2', $payload, event_type => 'OrderCreated')) FROM generate_series($3, $4) g"
  fi
}
claim_call() { # model size
  case $1 in
    P) echo "proto.claim('bench', $2)" ;;
    N) echo "proto.claim('bench', $2, true)" ;;
    *) echo "outbox_claim('bench', $2)" ;;
  esac
}
claim_sql() { # model size -> sets tok, ids
  if proto "$1"; then echo "SELECT max(token), array_agg(id) INTO tok, ids FROM $(claim_call "$1" "$2")"
  else echo "SELECT max(claim_token), array_agg(id) INTO tok, ids FROM $(claim_call "$1" "$2")"; fi
}
ack_sql() { # model
  if proto "$1"; then echo "PERFORM proto.ack('bench', tok, ids)"; else echo "PERFORM outbox_ack('bench', tok, ids)"; fi
}
reset_sql() { # model
  if proto "$1"; then echo "SELECT proto.reset()"; else echo "TRUNCATE outbox_event"; fi
}
backlog() { # model total transactions: empty outbox, then that many due events, VACUUM ANALYZE
  q -d "${dbof[$1]}" >/dev/null <<SQL
SET synchronous_commit = off;
SET outbox.notify = off;
$(reset_sql "$1");
DO \$\$
BEGIN
  FOR t IN 0..$(($3 - 1)) LOOP
    $(enqueue_sql "$1" bench.drain "t * $(($2 / $3)) + 1" "(t + 1) * $(($2 / $3))");
    COMMIT;
  END LOOP;
END \$\$;
VACUUM ANALYZE;
SQL
}
# The drain loop of drain-ab.sh: NOTICE "<events drained>|<events/s>".
drain_do() { # model size
  cat <<SQL
DO \$\$
DECLARE t0 timestamptz := clock_timestamp(); tok bigint; ids bigint[]; n bigint := 0;
BEGIN
  LOOP
    $(claim_sql "$1" "$2");
    EXIT WHEN ids IS NULL;
    n := n + cardinality(ids);
    COMMIT;
    $(ack_sql "$1");
    COMMIT;
  END LOOP;
  RAISE NOTICE '%|%', n, round(n / extract(epoch FROM clock_timestamp() - t0));
END \$\$;
SQL
}
lsn() { q -d postgres -c "SELECT pg_current_wal_insert_lsn()"; }
# The WAL of one model between two positions, "bytes fpi_bytes". With pg_walinspect: the records
# with a block in the model's database plus every record (commits) of a transaction that wrote
# one, so other work on the server (a test suite, say) does not count; record lengths, without
# page headers and alignment. Else, or if the WAL is gone: the server-wide distance and "-".
wal_of() { # model start end
  local out
  if [ $walinspect = 1 ] && out=$(q -d proto_ao -F ' ' <<SQL
SET work_mem = '256MB';
-- pg_walinspect reads flushed WAL only (the walwriter flushes an async commit within 200 ms).
DO \$\$ BEGIN FOR i IN 1..100 LOOP
  EXIT WHEN pg_current_wal_flush_lsn() >= '$3'; PERFORM pg_sleep(0.05); END LOOP; END \$\$;
WITH r AS MATERIALIZED (
       SELECT xid::text AS xid, record_length AS len, fpi_length AS fpi,
              coalesce(block_ref, '') LIKE '%/${dboid[$1]}/%' AS here
         FROM pg_get_wal_records_info('$2', '$3')),
     mine AS (SELECT DISTINCT xid FROM r WHERE here AND xid <> '0')
SELECT coalesce(sum(len), 0), coalesce(sum(fpi), 0) FROM r WHERE here OR xid IN (SELECT xid FROM mine);
SQL
  ); then echo "$out"; else echo "$(q -d postgres -c "SELECT pg_wal_lsn_diff('$3', '$2')::bigint") -"; fi
}
per() { echo $(( ($1 + $2 / 2) / $2 )); } # bytes count -> rounded bytes per item
declare -A dboid
for m in P N C V; do dboid[$m]=$(q -d postgres -c "SELECT oid FROM pg_database WHERE datname = '${dbof[$m]}'"); done

# ---------------------------------------------------------------------------------------------
# 2. WAL per event over a life: enqueue one per transaction, drain, retention.
declare -A wal_enq wal_drain wal_ret wal_life fpi_life lsn_life life_rate
for m in P C V; do
  db=${dbof[$m]}
  q -d "$db" -c "$(reset_sql $m)" -c "VACUUM" -c "CHECKPOINT" >/dev/null
  l0=$(lsn)
  # One event per transaction, as a producer would; synchronous_commit = off changes no record.
  q -d "$db" <<SQL
SET synchronous_commit = off;
SET outbox.notify = off;
DO \$\$
BEGIN
  FOR i IN 1..$events LOOP
    $(enqueue_sql $m bench.life i i);
    COMMIT;
  END LOOP;
END \$\$;
SQL
  l1=$(lsn)
  q -d "$db" -c "ANALYZE"
  l2=$(lsn)
  IFS='|' read -r drained rate <<<"$(drain_do $m "$batch" | notices "$db")"
  [ "$drained" = "$events" ] || fail "life run ${label[$m]}: drained $drained of $events events"
  l3=$(lsn)
  if proto $m; then
    # Retention by partition: once the cursor and every batch are past a partition, it goes whole.
    q -d "$db" -c "TRUNCATE proto.event_data"
  else
    q -d "$db" -c "DO \$\$ BEGIN WHILE outbox_purge('0 seconds', 1000000) > 0 LOOP COMMIT; END LOOP; END \$\$"
    left=$(q -d "$db" -c "SELECT count(*) FROM outbox_event")
    [ "$left" = 0 ] || fail "life run ${label[$m]}: purge left $left events"
  fi
  l4=$(lsn)
  read -r eb ef <<<"$(wal_of $m "$l0" "$l1")"
  read -r db_ df <<<"$(wal_of $m "$l2" "$l3")"
  read -r rb rf <<<"$(wal_of $m "$l3" "$l4")"
  wal_enq[$m]=$(per "$eb" "$events") wal_drain[$m]=$(per "$db_" "$events") wal_ret[$m]=$(per "$rb" "$events")
  wal_life[$m]=$(per $((eb + db_ + rb)) "$events") life_rate[$m]=$rate
  fpi_life[$m]=$([ "$ef" = - ] && echo n/a || per $((ef + df + rf)) "$events")
  lsn_life[$m]=$(per $(( $(q -d postgres -c "SELECT pg_wal_lsn_diff('$l1', '$l0') + pg_wal_lsn_diff('$l4', '$l2')") )) "$events")
done

# ---------------------------------------------------------------------------------------------
# 3. Drain rate, as drain-ab.sh: a backlog of due events (here in 1,000 transactions, so the
# prototype's windows span many txids), VACUUM ANALYZE, one drain; best of 3. Then what the one
# cursor costs: claim + ack cycles of 10 events (the fixed cost of a claim, which a single cursor
# serializes) and the WAL of a claim that finds nothing (an idle relay's poll).
declare -A best=([P]=0 [C]=0 [V]=0) small idle
for _ in 1 2 3; do  # the models take turns, so a burst of load on this machine hits all of them
  for m in P C V; do
    backlog $m "$events" 1000
    IFS='|' read -r drained rate <<<"$(drain_do $m "$batch" | notices "${dbof[$m]}")"
    [ "$drained" = "$events" ] || fail "drain ${label[$m]}: drained $drained of $events events"
    [ "$rate" -gt "${best[$m]}" ] && best[$m]=$rate
  done
done
for m in P C V; do
  for sync in on off; do  # on: each claim holds the cursor until its commit is flushed
    backlog $m 5000 500
    IFS='|' read -r drained rate <<<"$( { echo "SET synchronous_commit = $sync;"; drain_do $m 10; } | notices "${dbof[$m]}")"
    [ "$drained" = 5000 ] || fail "small claims ${label[$m]}: drained $drained of 5000 events"
    small[$m]+="${small[$m]:+ / }$((rate / 10))"
  done
  l0=$(lsn)
  q -d "${dbof[$m]}" -c "DO \$\$ DECLARE tok bigint; ids bigint[];
    BEGIN FOR i IN 1..1000 LOOP $(claim_sql $m "$batch"); COMMIT; END LOOP; END \$\$"
  read -r ib _ <<<"$(wal_of $m "$l0" "$(lsn)")"
  idle[$m]=$(per "$ib" 1000)
done

echo
echo "== 2./3. WAL bytes per event ($events events, ~90-byte payload) and drain (claim $batch + ack)"
row() { printf '%-14s %7s %9s %9s %6s %5s %8s | %10s %8s %8s | %18s %6s\n' "$@"; }
row model enqueue claim+ack retention life FPI "lsn life" "drain ev/s" "vs 0.1.0" life-run "claims/s@10 on/off" "idle B"
for m in P C V; do
  row "${label[$m]}" "${wal_enq[$m]}" "${wal_drain[$m]}" "${wal_ret[$m]}" "${wal_life[$m]}" "${fpi_life[$m]}" \
    "${lsn_life[$m]}" "${best[$m]}" "$(awk -v a="${best[$m]}" -v b="${best[V]}" 'BEGIN { printf "%.2fx", a / b }')" \
    "${life_rate[$m]}" "${small[$m]}" "${idle[$m]}"
done
cat <<EOF
  WAL: the records of the model's database (pg_walinspect; FPI: the full-page images among them;
  each life starts after a CHECKPOINT); lsn life: the server-wide insert-position distance over
  the same phases, which counts whatever else the server did meanwhile. drain: best of 3, backlog
  in 1,000 transactions, vacuumed; life-run: the drain of the WAL run (one event per transaction,
  not vacuumed). claims/s@10: claim(10) + ack cycles per second of one session,
  synchronous_commit on / off. idle B: WAL of one claim (committed) that finds nothing.
EOF

# ---------------------------------------------------------------------------------------------
# 4. Held snapshot / held writer.
hold() { # db snapshot|writer: starts the holder in the background, returns once it holds
  local db=$1 first
  if [ "$2" = snapshot ]; then first="BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pg_class;"
  else first="BEGIN; SELECT pg_current_xact_id();"; fi
  PGAPPNAME=proto_ao_holder psql -X -q -d "$db" -c "$first SELECT pg_sleep(600)" >/dev/null 2>&1 &
  holder_pid=$!; bg_pids+=("$holder_pid")
  until [ "$(q -d "$db" -c "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'proto_ao_holder'
               AND backend_xmin IS NOT NULL AND state = 'active'")" = 1 ]; do sleep 0.1; done
}
release() { # db: ends the holder's backend (ours, found by its application name), then its client
  q -d "$1" -c "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'proto_ao_holder'" >/dev/null
  wait "$holder_pid" 2>/dev/null || true
}
# A claim run under EXPLAIN (ANALYZE, BUFFERS) into json j: the buffers it touches include the
# function's own statements. Its batch is then acked outside the measurement.
explained_claim() { # model size
  local refetch
  if proto "$1"; then refetch="SELECT token, pending INTO tok, ids FROM proto.batch WHERE owner = 'bench'"
  else refetch="SELECT claim_token, array_agg(id) INTO tok, ids FROM outbox_event WHERE status = 'SENDING' GROUP BY 1"; fi
  cat <<SQL
    EXECUTE 'EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT * FROM $(claim_call "$1" "$2" | sed "s/'/''/g")' INTO j;
    COMMIT;
    $refetch;
    n := n + coalesce(cardinality(ids), 0);
    $(ack_sql "$1");
    COMMIT;
SQL
}
buffers="(j->0->'Plan'->>'Shared Hit Blocks')::int + (j->0->'Plan'->>'Shared Read Blocks')::int"
held_rounds() { # model -> per round "buffers|1st claim ms|avg claim ms", after an empty outbox
  local m=$1 db=${dbof[$1]}
  q -d "$db" -c "$(reset_sql "$m")" -c "VACUUM ANALYZE" >/dev/null
  for r in $(seq 10); do
    notices "$db" <<SQL
SET synchronous_commit = off;
SET outbox.notify = off;
DO \$\$
DECLARE j json; t0 timestamptz; tok bigint; ids bigint[]; claims int := 0; spent float8 := 0; n int := 0;
BEGIN
  FOR t IN 0..99 LOOP  -- the round's events, in 100 transactions
    $(enqueue_sql "$m" bench.held "$(((r - 1) * round)) + t * $((round / 100)) + 1" "$(((r - 1) * round)) + (t + 1) * $((round / 100))");
    COMMIT;
  END LOOP;
$(explained_claim "$m" "$batch")
  LOOP
    t0 := clock_timestamp();
    $(claim_sql "$m" "$batch");
    EXIT WHEN ids IS NULL;
    spent := spent + extract(epoch FROM clock_timestamp() - t0);
    claims := claims + 1;
    n := n + cardinality(ids);
    COMMIT;
    $(ack_sql "$m");
    COMMIT;
  END LOOP;
  IF n <> $round THEN RAISE EXCEPTION 'round $r: claimed % of $round events', n; END IF;
  RAISE NOTICE '%|%|%', $buffers, round((j->0->>'Execution Time')::numeric, 2),
    round((spent * 1000 / greatest(claims, 1))::numeric, 2);
END \$\$;
SQL
  done
}
# Many small claims under the held snapshot: each leaves a cursor version nothing may prune, and
# the cursor row is found by a scan over all of them.
held_small() { # -> "buffers of claim 2|of the last claim|cursor pages|ms of claim 2|of the last"
  notices proto_ao <<SQL
SET synchronous_commit = off;
DO \$\$
DECLARE j json; tok bigint; ids bigint[]; n int := 0; b_first int; ms_first numeric;
BEGIN
  FOR t IN 0..99 LOOP
    $(enqueue_sql P bench.small "t * 100 + 1" "(t + 1) * 100");
    COMMIT;
  END LOOP;
  FOR i IN 1..1999 LOOP
    IF i = 2 THEN
$(explained_claim P 5)
      b_first := $buffers; ms_first := round((j->0->>'Execution Time')::numeric, 2);
    ELSE
      $(claim_sql P 5);
      n := n + cardinality(ids);
      COMMIT;
      $(ack_sql P);
      COMMIT;
    END IF;
  END LOOP;
$(explained_claim P 5)
  RAISE NOTICE '%|%|%|%|%', b_first, $buffers, pg_relation_size('proto.cursor') / 8192,
    ms_first, round((j->0->>'Execution Time')::numeric, 2);
END \$\$;
SQL
}

hold proto_ao snapshot
held_p=$(held_rounds P)
IFS='|' read -r small_b1 small_b2 small_pages small_ms1 small_ms2 <<<"$(held_small)"
release proto_ao
hold proto_ao_cur snapshot; held_c=$(held_rounds C); release proto_ao_cur
hold proto_ao writer;       held_w=$(held_rounds P); held_n=$(held_rounds N); release proto_ao
for h in "$held_p" "$held_c" "$held_w" "$held_n"; do
  [ "$(grep -c . <<<"$h")" = 10 ] || fail "held-snapshot rounds: a round failed (see the errors above)"
done

echo
echo "== 4. rounds of $round events enqueued, then claimed ($batch) and acked, while another session holds a snapshot"
echo "   buf = shared buffers hit+read by the round's first claim (EXPLAIN ANALYZE BUFFERS); 1st = its ms; avg = mean ms of the other claims"
printf '%5s %7s | %-23s | %-23s | %-23s | %-23s\n' "" "" "prototype" "outbox $current" "prototype" "prototype, naive range"
printf '%5s %7s | %-23s | %-23s | %-23s | %-23s\n' "" "" "held RR snapshot" "held RR snapshot" "held writing xact" "held writing xact"
printf '%5s %7s |%s|%s|%s|%s\n' round events "$(printf ' %6s %7s %7s ' buf 1st avg)" "$(printf ' %6s %7s %7s ' buf 1st avg)" \
  "$(printf ' %6s %7s %7s ' buf 1st avg)" "$(printf ' %6s %7s %7s ' buf 1st avg)"
paste -d'|' <(echo "$held_p") <(echo "$held_c") <(echo "$held_w") <(echo "$held_n") | awk -F'|' -v n="$round" \
  '{ printf "%5d %7d | %6s %7s %7s | %6s %7s %7s | %6s %7s %7s | %6s %7s %7s\n", NR, NR * n,
     $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12 }'
echo "   prototype, held RR snapshot, then 2,000 claims of 5 events: a claim touches $small_b1 buffers ($small_ms1 ms)"
echo "   at the start, $small_b2 ($small_ms2 ms) at the end; the cursor table has grown to $small_pages pages (one version per claim)"

echo
if [ $failed = 0 ]; then echo "all checks PASS"; else echo "some checks FAILED"; exit 1; fi
