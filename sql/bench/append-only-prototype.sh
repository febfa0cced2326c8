#!/usr/bin/env bash
# Prototype of docs/design-append-only.md in plain SQL, measured against today's model in the same
# run. Not the extension: an experiment that turns the note's "expected cost" into figures.
#
# What it builds (schema `proto` of a scratch database):
#   event_data  insert-only event rows; txid = pg_current_xact_id(); the PK, a (txid, id) index and
#               a partial (topic, event_key, id) index on keyed events (the predecessor check below)
#   cursor      one row: two pg_snapshots (prev, cur) and a position (pos_txid, pos_id)
#   batch       one row per claim: token, owner, claimed_at, pending bigint[]
#   claim()     PgQ's batch rule: lock the cursor row (FOR UPDATE SKIP LOCKED), hand out up to max
#               events whose txid is visible in cur and not in prev, in (txid, id) order from the
#               position; rotate (prev := cur, cur := pg_current_snapshot()) when that set is used
#               up. Prev's in-progress txids are looked up by equality and the rest read as a range
#               from xmax(prev) (PgQ's trick); claim(owner, max, true) reads the note's literal
#               range from xmin(prev) instead, for comparison only.
#   ack()       removes ids from the batch's pending array; deletes the batch once it is empty
#   retry       the exception table (outbox_retry): nacked, reclaimed and diverted events, with
#               today's per-row state; keyed rows behind their key's first row wait at infinity
#   nack(), reclaim(lease)  move a batch's events (fresh or retried) there; retry^2 x 5 s, FAIL
#               after the 4th failure. claim() takes due retry runs in place first (fenced by
#               owner + token, keys split by a try-lock), then fresh events; a fresh keyed event
#               whose key is busy (in an unsettled batch: batch.keys, or in retry) is diverted to
#               retry in the same call. So is one whose predecessor (the key's next lower id: id is
#               commit order within a key, txid is not when the producer drew it before the key
#               lock) is still ahead in the window; it waits in retry (wait_for) until the
#               predecessor, diverted in turn, lands before it. Fresh events go out in id order.
# Left out on purpose: release, renew, requeue, skip (head_of_line = block only), the
# outbox_event view, real partitions, unordered_topics (a keyed event here is always ordered).
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
#   5. Keys and retries (PASS/FAIL): 3 producers over 50 keys (key lock before the insert, as
#      outbox_enqueue), 2 claimers nacking at random and poison events to death, one abandoned
#      batch reclaimed: (d) per key, first hand-outs in commit order; (e) no hand-out before every
#      earlier event of its key is acked (or in the same batch); (f) nothing after a dead head;
#      (g) none lost; (h) unkeyed events unaffected. (i) producers that draw their txid before the
#      key lock (txid order against commit order within a key): a forced pair with claims of 1,
#      then 4 producers over 4 keys drained with claims of 1-3: per key commit order, none lost,
#      none twice.
#   6. Keys: buffers and ms of one claim of BATCH, and drain ev/s, over 1, 10,000 and 100,000
#      keys against today's model; the busy-key check with batches in flight; a hot key drained
#      with 2 batches in flight (every later event goes through retry); WAL of a life, 10,000 keys.
#
# Usage: [ONLY=keys|5|6] sql/bench/append-only-prototype.sh [EVENTS] [BATCH]
#   (defaults 100000 500; ~8 minutes; ONLY=5 ~15 s, ONLY=6 ~5 minutes)
# Needs the PostgreSQL 15 server of scripts/setup with the outbox extension installed, and
# pg_walinspect (contrib) for the FPI column. Uses the scratch databases proto_ao, proto_ao_cur
# and proto_ao_v010, dropped on exit. Writes no file. Section 3's rates move a lot on a loaded
# machine: compare models within one run.
set -euo pipefail
export PGHOST=${PGHOST:-127.0.0.1} PGPORT=${PGPORT:-5432} PGUSER=${PGUSER:-postgres}
events=${1:-100000} batch=${2:-500}
only=${ONLY:-}  # ONLY=keys: only sections 5 and 6 (keys and retries); ONLY=5 or ONLY=6: that one
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
-- A keyed event's predecessor (the key's next lower id): the claim checks that it is not still
-- ahead in the window (see part C). Keyed events only; inserted once, never updated either.
CREATE INDEX event_data_key_idx ON proto.event_data (topic, event_key, id) WHERE event_key IS NOT NULL;

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
-- One row per claim that handed something out; deleted once pending and retried are both empty.
CREATE TABLE proto.batch (
    token      bigint PRIMARY KEY DEFAULT nextval('proto.batch_token_seq'),
    owner      text NOT NULL,
    claimed_at timestamptz NOT NULL,
    pending    bigint[] NOT NULL,              -- fresh events (from the cursor) not settled yet
    retried    bigint[] NOT NULL DEFAULT '{}', -- proto.retry rows this claim took in place
    -- proto.kh of the keys of its fresh keyed events: those keys are busy while the row lives.
    -- Kept on a row the claim writes anyway (no per-key row, index entry or dead version); a
    -- partial ack leaves it as is (conservative: the key stays busy until the batch is gone).
    keys       bigint[]
);

-- The exception table: nacked, reclaimed and diverted (busy key) events. The event row stays in
-- event_data untouched; this row carries today's per-row state. Keyed rows behind the first row
-- of their key (id order = commit order within a key) wait with next_retry_time = infinity
-- (proto.fix_heads keeps it so): the due range then holds one row per key, and a key blocked by
-- a dead head (or backing off) is never read again by later claims.
CREATE TABLE proto.retry (
    id              bigint PRIMARY KEY,
    topic           text NOT NULL,
    event_key       text,
    status          text NOT NULL CHECK (status IN ('WAIT', 'SENDING', 'FAIL')),
    retry_count     int NOT NULL DEFAULT 0,
    next_retry_time timestamptz NOT NULL,
    claim_owner     text,
    claim_token     bigint,
    claimed_at      timestamptz,
    last_error      text,
    -- A diverted event whose predecessor (lower id of its key) was still ahead in the cursor's
    -- window: its id. The row is no head (not due) until that event reaches proto.retry too.
    wait_for        bigint
);
CREATE INDEX retry_key_idx ON proto.retry (topic, event_key, id) WHERE event_key IS NOT NULL;
CREATE INDEX retry_due_idx ON proto.retry (next_retry_time, id) WHERE status = 'WAIT';
CREATE INDEX retry_wait_for_idx ON proto.retry (wait_for) WHERE wait_for IS NOT NULL;  -- empty but on an inversion

-- A key's 64-bit hash, as batch.keys stores it (NULL for an unkeyed event).
CREATE FUNCTION proto.kh(topic text, event_key text) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$ SELECT hashtextextended(topic || '/' || event_key, 0) $$;

-- Today's rule (outbox_status_after_failure, outbox.max_retry = 3) and backoff, n^2 x base
-- (5 s; the checks set proto.backoff_ms to a few ms). No jitter: none is needed here.
CREATE FUNCTION proto.after_failure(attempts int) RETURNS text
LANGUAGE sql IMMUTABLE AS $$ SELECT CASE WHEN attempts > 3 THEN 'FAIL' ELSE 'WAIT' END $$;
CREATE FUNCTION proto.backoff(attempts int) RETURNS interval
LANGUAGE sql STABLE AS $$
    SELECT make_interval(secs => least(attempts * attempts * coalesce(nullif(current_setting('proto.backoff_ms', true), '')::int, 5000),
                                       3600000) / 1000.0)
$$;

-- Keeps "one due row per key": for the given keys, rows behind the key's first row wait at
-- infinity, and a first row left at infinity (its predecessor was just acked) is due now. Driven
-- by the due index (only heads and unkeyed rows are below infinity), never by a key's backlog.
CREATE FUNCTION proto.fix_heads(p_topics text[], p_keys text[]) RETURNS void LANGUAGE sql AS $$
    -- The keys' lock (part A's try-lock) first, so the UPDATEs below (new snapshots) see the
    -- other fix_heads of these keys committed: an ack deleting a key's head while a claim diverts
    -- the key's next event left that event at infinity, no one's head (check (i) caught it).
    SELECT pg_advisory_xact_lock(7, h) FROM (SELECT DISTINCT hashtext(t.topic || '/' || t.event_key) AS h
                                               FROM unnest(p_topics, p_keys) t(topic, event_key)
                                              WHERE t.event_key IS NOT NULL ORDER BY 1) k;
    WITH k AS (SELECT DISTINCT t.topic, t.event_key FROM unnest(p_topics, p_keys) t(topic, event_key)
                WHERE t.event_key IS NOT NULL),
         due AS MATERIALIZED (SELECT r.id, r.topic, r.event_key FROM proto.retry r
                               WHERE r.status = 'WAIT' AND r.next_retry_time < 'infinity')
    UPDATE proto.retry r SET next_retry_time = 'infinity'
      FROM due d JOIN k USING (topic, event_key)
     WHERE r.id = d.id
       AND r.id > (SELECT min(h.id) FROM proto.retry h WHERE h.topic = k.topic AND h.event_key = k.event_key);
    UPDATE proto.retry r SET next_retry_time = clock_timestamp()
      FROM (SELECT DISTINCT t.topic, t.event_key FROM unnest(p_topics, p_keys) t(topic, event_key)
             WHERE t.event_key IS NOT NULL) k
     WHERE r.id = (SELECT min(h.id) FROM proto.retry h WHERE h.topic = k.topic AND h.event_key = k.event_key)
       AND r.status = 'WAIT' AND r.next_retry_time = 'infinity' AND r.wait_for IS NULL;
$$;

-- Back to an empty outbox with the cursor at "now" (between experiments).
CREATE FUNCTION proto.reset() RETURNS void LANGUAGE sql AS $$
    TRUNCATE proto.event_data, proto.batch, proto.retry;
    UPDATE proto.cursor SET prev_snap = pg_current_snapshot(), cur_snap = pg_current_snapshot(),
                            pos_txid = '0', pos_id = 0;
$$;

-- p_naive: the design note's literal range, txid from xmin(prev) filtered by both snapshots (only
-- for the held-writer comparison of section 4); the default reads prev's in-progress txids by
-- equality and the rest from xmax(prev).
CREATE FUNCTION proto.claim(p_owner text, p_max int, p_naive boolean DEFAULT false)
RETURNS TABLE (token bigint, id bigint, event_id uuid, txid xid8, topic text, event_key text,
               event_type text, payload jsonb, headers jsonb, created_at timestamptz,
               from_retry boolean)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    now_ timestamptz := clock_timestamp();
    heads bigint[];      -- due proto.retry rows whose key this claim locked (or unkeyed)
    r_ids bigint[] := '{}';  -- proto.retry rows claimed in place
    out_ids bigint[];    -- fresh events handed out
    div_ids bigint[];    -- fresh events of busy keys, moved to proto.retry
    out_keys bigint[];
    div_topics text[];
    div_keys text[];
    div_waits bigint[];
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
    -- A. Due retry rows first (they are older than anything fresh of their key). The due range
    -- holds heads only (proto.fix_heads); a head whose key has an earlier event in an unsettled
    -- batch waits. Keys are split between concurrent claimers by a try-lock held until commit.
    -- The busy keys of unsettled batches are read in the same statement (same snapshot) as the
    -- heads: the batches in flight are few, read whole into a hashed subplan (one heap page per
    -- ~50 batches, plus their dead versions while an old snapshot is held).
    heads := ARRAY(
        SELECT r.id FROM (SELECT r.id, r.topic, r.event_key FROM proto.retry r
                           WHERE r.status = 'WAIT' AND r.next_retry_time <= now_
                           ORDER BY r.next_retry_time, r.id LIMIT p_max) r
         WHERE r.event_key IS NULL
            OR (proto.kh(r.topic, r.event_key) NOT IN (SELECT k FROM proto.batch b, unnest(b.keys) k)
                AND pg_try_advisory_xact_lock(7, hashtext(r.topic || '/' || r.event_key))));
    IF cardinality(heads) > 0 THEN
        tok := nextval('proto.batch_token_seq');
        -- A new statement, so a new snapshot: taken after the key locks, it sees everything the
        -- last holder of each key committed. A key's run: its rows from the first in id order,
        -- as long as they are WAIT (the first one due): nothing after a held, backing-off or dead
        -- row. Cut by head due time with a run as one block, so a cut keeps a prefix.
        WITH k AS (SELECT DISTINCT r.topic, r.event_key FROM proto.retry r
                    WHERE r.id = ANY (heads) AND r.event_key IS NOT NULL),
             runs AS (SELECT v.id, v.head_due, k.topic, k.event_key FROM k, LATERAL (
                        SELECT w.id, first_value(w.next_retry_time) OVER (ORDER BY w.id) AS head_due,
                               bool_and(w.status = 'WAIT' AND w.wait_for IS NULL AND (w.pos > 1 OR w.next_retry_time <= now_))
                                 OVER (ORDER BY w.id) AS ok
                          FROM (SELECT r.id, r.status, r.next_retry_time, r.wait_for, row_number() OVER (ORDER BY r.id) AS pos
                                  FROM proto.retry r WHERE r.topic = k.topic AND r.event_key = k.event_key
                                 ORDER BY r.id LIMIT p_max) w) v
                       WHERE v.ok),
             loose AS (SELECT r.id, r.next_retry_time AS head_due, r.topic, r.event_key FROM proto.retry r
                        WHERE r.id = ANY (heads) AND r.event_key IS NULL AND r.status = 'WAIT'
                        FOR UPDATE SKIP LOCKED),
             chosen AS (SELECT x.id FROM (SELECT * FROM runs UNION ALL SELECT * FROM loose) x
                         ORDER BY x.head_due, x.topic, x.event_key, x.id LIMIT p_max),
             upd AS (UPDATE proto.retry r SET status = 'SENDING', claim_owner = p_owner, claim_token = tok,
                                              claimed_at = now_
                      WHERE r.id IN (SELECT chosen.id FROM chosen) AND r.status = 'WAIT' RETURNING r.id)
        SELECT coalesce(array_agg(upd.id ORDER BY upd.id), '{}') INTO r_ids FROM upd;
    END IF;

    -- B. Fresh events from the cursor, for what the retries left of the batch.
    -- One claimer at a time owns the cursor; the others serve retries only.
    -- Locking follows the update chain: we read the latest cursor.
    IF cardinality(r_ids) < p_max THEN
      p_max := p_max - cardinality(r_ids);
      SELECT * INTO c FROM proto.cursor FOR UPDATE SKIP LOCKED;
    END IF;
    IF c.one IS NOT NULL THEN
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
    END IF;  -- c.one IS NOT NULL

    -- C. Keys: a fresh keyed event whose key is busy (in an unsettled batch, or with rows in
    -- proto.retry, including the ones part A just took) is not handed out but moved to
    -- proto.retry, behind its key's earlier events. Busy is a property of the key, so a key's
    -- events in this window go out together or move together.
    -- Read after the cursor lock, in one statement: the batches of the previous cursor holder
    -- are visible (reading them before the lock let a key's event overtake: check (e) caught it).
    -- A key is also busy when an event's predecessor (next lower id of its key, commit order) is
    -- still ahead in the window: its txid was drawn before the key lock, so (txid, id) puts it
    -- after (check (i)). The key's events here move to proto.retry, the early one marked
    -- wait_for: not due until the predecessor, diverted in turn when the cursor reaches it (its key
    -- is busy), lands before it. One probe of event_data_key_idx per keyed event, skipped when
    -- this claim used up its window (nothing is ahead): a relay that keeps up pays nothing.
    IF cardinality(ids) > 0 THEN
        SELECT array_agg(s.id ORDER BY s.id) FILTER (WHERE NOT s.busy),
               array_agg(s.id ORDER BY s.id) FILTER (WHERE s.busy),
               array_agg(s.topic ORDER BY s.id) FILTER (WHERE s.busy),
               array_agg(s.event_key ORDER BY s.id) FILTER (WHERE s.busy),
               array_agg(s.wait_for ORDER BY s.id) FILTER (WHERE s.busy),
               array_agg(DISTINCT s.kh) FILTER (WHERE s.kh IS NOT NULL AND NOT s.busy)
          INTO out_ids, div_ids, div_topics, div_keys, div_waits, out_keys
          FROM (SELECT e.id, e.topic, e.event_key, h.kh, e.wait_for,
                       e.busy OR bool_or(e.wait_for IS NOT NULL) OVER (PARTITION BY h.kh) AS busy
                  FROM (SELECT e.id, e.topic, e.event_key,
                               CASE WHEN e.event_key IS NULL THEN false
                                    ELSE proto.kh(e.topic, e.event_key) IN (SELECT k FROM proto.batch b, unnest(b.keys) k)  -- hashed, built once
                                         OR EXISTS (SELECT 1 FROM proto.retry r
                                                     WHERE r.topic = e.topic AND r.event_key = e.event_key) END AS busy,
                               CASE WHEN e.event_key IS NOT NULL AND cardinality(ids) >= p_max THEN
                               (SELECT p.id FROM (SELECT p.id, p.txid FROM proto.event_data p
                                                   WHERE p.topic = e.topic AND p.event_key = e.event_key AND p.id < e.id
                                                   ORDER BY p.id DESC LIMIT 1) p
                                 WHERE pg_visible_in_snapshot(p.txid, c.cur_snap) AND NOT pg_visible_in_snapshot(p.txid, c.prev_snap)
                                   AND (p.txid, p.id) > (c.pos_txid, c.pos_id)) END AS wait_for
                          FROM proto.event_data e WHERE e.id = ANY (ids)) e
                  CROSS JOIN LATERAL (SELECT proto.kh(e.topic, e.event_key) AS kh) h) s;
        IF div_ids IS NOT NULL THEN
            INSERT INTO proto.retry (id, topic, event_key, status, next_retry_time, wait_for)
            SELECT t.id, t.topic, t.event_key, 'WAIT', CASE WHEN t.wait_for IS NULL THEN now_ ELSE 'infinity' END, t.wait_for
              FROM unnest(div_ids, div_topics, div_keys, div_waits) t(id, topic, event_key, wait_for);
            -- The predecessors that just arrived release the rows waiting for them.
            UPDATE proto.retry r SET wait_for = NULL WHERE r.wait_for = ANY (div_ids);
            PERFORM proto.fix_heads(div_topics, div_keys);
        END IF;
    END IF;
    IF out_ids IS NULL AND cardinality(r_ids) = 0 THEN RETURN; END IF;
    tok := coalesce(tok, nextval('proto.batch_token_seq'));
    INSERT INTO proto.batch (token, owner, claimed_at, pending, retried, keys)
    VALUES (tok, p_owner, now_, coalesce(out_ids, '{}'), r_ids, out_keys);
    -- Retry rows first (each key's earlier events), then the fresh ones in id order (commit
    -- order within a key; a key's events of one batch may have their txids the other way round).
    RETURN QUERY SELECT tok, e.id, e.event_id, e.txid, e.topic, e.event_key, e.event_type,
                        e.payload, e.headers, e.created_at, true
                   FROM proto.event_data e WHERE e.id = ANY (r_ids) ORDER BY e.id;
    RETURN QUERY SELECT tok, e.id, e.event_id, e.txid, e.topic, e.event_key, e.event_type,
                        e.payload, e.headers, e.created_at, false
                   FROM proto.event_data e WHERE e.id = ANY (out_ids) ORDER BY e.id;
END
$$;

-- Takes settled ids off a batch row (locked by the caller); deletes the row once nothing is left.
-- Returns how many ids it still waits for. A partial settle rewrites the whole arrays (one
-- datum): k partial acks of a batch cost k copies.
CREATE FUNCTION proto.forget(bt proto.batch, p_ids bigint[]) RETURNS int
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    bt.pending := ARRAY(SELECT unnest(bt.pending) EXCEPT SELECT unnest(p_ids) ORDER BY 1);
    bt.retried := ARRAY(SELECT unnest(bt.retried) EXCEPT SELECT unnest(p_ids) ORDER BY 1);
    IF bt.pending = '{}' AND bt.retried = '{}' THEN
        DELETE FROM proto.batch WHERE token = bt.token;
    ELSE
        UPDATE proto.batch SET pending = bt.pending, retried = bt.retried WHERE token = bt.token;
    END IF;
    RETURN cardinality(bt.pending) + cardinality(bt.retried);
END
$$;

-- Returns how many ids the batch still waits for (0: settled and deleted), NULL if the owner
-- holds no such batch.
CREATE FUNCTION proto.ack(p_owner text, p_token bigint, p_ids bigint[]) RETURNS int
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    bt proto.batch%ROWTYPE;
    t text[];
    k text[];
BEGIN
    -- The usual case, an ack of the whole batch of fresh events: one DELETE, no new row version.
    DELETE FROM proto.batch x
     WHERE x.token = p_token AND x.owner = p_owner AND x.retried = '{}'
       AND NOT EXISTS (SELECT unnest(x.pending) EXCEPT SELECT unnest(p_ids));
    IF FOUND THEN RETURN 0; END IF;
    SELECT * INTO bt FROM proto.batch WHERE token = p_token AND owner = p_owner FOR UPDATE;
    IF NOT FOUND THEN RETURN NULL; END IF;
    -- Retry rows held by this claim are done: deleted; the next row of each key becomes its head.
    IF bt.retried && p_ids THEN
        WITH d AS (DELETE FROM proto.retry r
                    WHERE r.id = ANY (p_ids) AND r.id = ANY (bt.retried) AND r.status = 'SENDING'
                      AND r.claim_owner = p_owner AND r.claim_token = p_token
                   RETURNING r.topic, r.event_key)
        SELECT array_agg(d.topic), array_agg(d.event_key) INTO t, k FROM d WHERE d.event_key IS NOT NULL;
        IF t IS NOT NULL THEN PERFORM proto.fix_heads(t, k); END IF;
    END IF;
    RETURN proto.forget(bt, p_ids);
END
$$;

-- A failed attempt for ids of the batch: fresh ones enter proto.retry (attempt 1), retry rows count
-- one more; WAIT after retry^2 x base, FAIL after the 4th failure (outbox.max_retry = 3). The
-- caller (the relay) nacks a failed event together with the later events of its key in the batch.
-- Returns how many ids it settled.
CREATE FUNCTION proto.nack(p_owner text, p_token bigint, p_ids bigint[], p_error text DEFAULT NULL)
RETURNS int LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    bt proto.batch%ROWTYPE;
    now_ timestamptz := clock_timestamp();
    t text[];
    k text[];
    n int;
BEGIN
    SELECT * INTO bt FROM proto.batch WHERE token = p_token AND owner = p_owner FOR UPDATE;
    IF NOT FOUND THEN RETURN 0; END IF;
    WITH fresh AS (
        INSERT INTO proto.retry (id, topic, event_key, status, retry_count, next_retry_time, last_error)
        SELECT e.id, e.topic, e.event_key, proto.after_failure(1), 1, now_ + proto.backoff(1), p_error
          FROM proto.event_data e WHERE e.id = ANY (p_ids) AND e.id = ANY (bt.pending)
        RETURNING topic, event_key
    ), again AS (
        UPDATE proto.retry r
           SET retry_count = r.retry_count + 1, status = proto.after_failure(r.retry_count + 1),
               next_retry_time = now_ + proto.backoff(r.retry_count + 1),
               claim_owner = NULL, claim_token = NULL, claimed_at = NULL,
               last_error = coalesce(p_error, r.last_error)
         WHERE r.id = ANY (p_ids) AND r.id = ANY (bt.retried) AND r.status = 'SENDING'
           AND r.claim_owner = p_owner AND r.claim_token = p_token
        RETURNING r.topic, r.event_key
    ), x AS (SELECT * FROM fresh UNION ALL SELECT * FROM again)
    SELECT array_agg(x.topic), array_agg(x.event_key), count(*) INTO t, k, n FROM x;
    PERFORM proto.fix_heads(t, k);
    PERFORM proto.forget(bt, p_ids);
    RETURN n;
END
$$;

-- Batches older than the lease: their unsettled events count a failed attempt and go to
-- proto.retry, due now (or FAIL). Returns how many events it moved.
CREATE FUNCTION proto.reclaim(p_lease interval) RETURNS int LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    bt proto.batch%ROWTYPE;
    now_ timestamptz := clock_timestamp();
    why text;
    t text[];
    k text[];
    n int;
    total int := 0;
BEGIN
    -- SKIP LOCKED: a batch locked right now is being settled by its owner.
    FOR bt IN SELECT * FROM proto.batch WHERE claimed_at < now_ - p_lease ORDER BY token FOR UPDATE SKIP LOCKED LOOP
        why := format('lease expired: claimed by %s at %s', bt.owner, bt.claimed_at);
        WITH fresh AS (
            INSERT INTO proto.retry (id, topic, event_key, status, retry_count, next_retry_time, last_error)
            SELECT e.id, e.topic, e.event_key, proto.after_failure(1), 1, now_, why
              FROM proto.event_data e WHERE e.id = ANY (bt.pending)
            RETURNING topic, event_key
        ), again AS (
            UPDATE proto.retry r
               SET retry_count = r.retry_count + 1, status = proto.after_failure(r.retry_count + 1),
                   next_retry_time = now_, claim_owner = NULL, claim_token = NULL, claimed_at = NULL,
                   last_error = why
             WHERE r.id = ANY (bt.retried) AND r.status = 'SENDING' AND r.claim_token = bt.token
            RETURNING r.topic, r.event_key
        ), x AS (SELECT * FROM fresh UNION ALL SELECT * FROM again)
        SELECT array_agg(x.topic), array_agg(x.event_key), count(*) INTO t, k, n FROM x;
        PERFORM proto.fix_heads(t, k);
        DELETE FROM proto.batch WHERE token = bt.token;
        total := total + n;
    END LOOP;
    RETURN total;
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
if [ -z "$only" ]; then
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
fi  # section 1

# ---------------------------------------------------------------------------------------------
# The models, as SQL snippets: (P)rototype, (N) the prototype with the note's literal range
# (section 4 only), today's (C)urrent default version, (V) 0.1.0.
payload="jsonb_build_object('order_id', g, 'customer', 'c' || (g % 977), 'amount', 42.50)"
declare -A dbof=([P]=proto_ao [N]=proto_ao [C]=proto_ao_cur [V]=proto_ao_v010)
declare -A label=([P]="prototype" [C]="outbox $current" [V]="outbox 0.1.0")
proto() { [[ $1 == [PN] ]]; }
enqueue_sql() { # model topic lo hi [key expression of g] -> events g in [lo, hi], one statement
  local key=${5:-NULL}
  if proto "$1"; then
    echo "INSERT INTO proto.event_data (topic, event_key, event_type, payload) SELECT '$2', $key, 'OrderCreated', $payload FROM generate_series($3, $4) g"
  else
    echo "PERFORM count(outbox_enqueue('$2', $payload, key => $key, event_type => 'OrderCreated')) FROM generate_series($3, $4) g"
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
  # outbox_key (0.4.0 on) too: a key row left by an earlier keyed run would keep its old due time.
  if proto "$1"; then echo "SELECT proto.reset()"
  elif [ "$1" = C ]; then echo "TRUNCATE outbox_event, outbox_key"
  else echo "TRUNCATE outbox_event"; fi
}
backlog() { # model total transactions [key expression of g]: empty outbox, then that many due events, VACUUM ANALYZE
  q -d "${dbof[$1]}" >/dev/null <<SQL
SET synchronous_commit = off;
SET outbox.notify = off;
$(reset_sql "$1");
DO \$\$
BEGIN
  FOR t IN 0..$(($3 - 1)) LOOP
    $(enqueue_sql "$1" bench.drain "t * $(($2 / $3)) + 1" "(t + 1) * $(($2 / $3))" "${4:-}");
    COMMIT;
  END LOOP;
END \$\$;
VACUUM ANALYZE;
SQL
}
# Claims and acks until a claim finds nothing, each call committed; counts the events in n.
drain_loop() { # model size
  cat <<SQL
  LOOP
    $(claim_sql "$1" "$2");
    EXIT WHEN ids IS NULL;
    n := n + cardinality(ids);
    COMMIT;
    $(ack_sql "$1");
    COMMIT;
  END LOOP;
SQL
}
# The drain loop of drain-ab.sh: NOTICE "<events drained>|<events/s>".
drain_do() { # model size
  cat <<SQL
DO \$\$
DECLARE t0 timestamptz := clock_timestamp(); tok bigint; ids bigint[]; n bigint := 0;
BEGIN
$(drain_loop "$1" "$2")
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
wal_life_run() { # model row-label [key expression of g] -> fills the arrays above for the label
  local m=$1 lab=$2 key=${3:-}
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
    $(enqueue_sql $m bench.life i i "$key");
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
  wal_enq[$lab]=$(per "$eb" "$events") wal_drain[$lab]=$(per "$db_" "$events") wal_ret[$lab]=$(per "$rb" "$events")
  wal_life[$lab]=$(per $((eb + db_ + rb)) "$events") life_rate[$lab]=$rate
  # n/a when pg_walinspect could not read a phase (its WAL already recycled, a server restart).
  fpi_life[$lab]=$([[ "$ef $df $rf" =~ ^[0-9]+\ [0-9]+\ [0-9]+$ ]] && per $((ef + df + rf)) "$events" || echo n/a)
  lsn_life[$lab]=$(per $(( $(q -d postgres -c "SELECT pg_wal_lsn_diff('$l1', '$l0') + pg_wal_lsn_diff('$l4', '$l2')") )) "$events")
}
if [ -z "$only" ]; then
for m in P C V; do wal_life_run $m $m; done

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
fi  # sections 2 and 3

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

if [ -z "$only" ]; then
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
fi  # section 4

# ---------------------------------------------------------------------------------------------
# 5. Keys and retries: correctness. Producers enqueue over 50 keys (and some unkeyed events),
# taking the key's advisory lock before the insert, as outbox_enqueue does, so within a key id,
# txid and commit order agree. Two claimers act as relays: a poison event is always nacked (it
# dies after 4 attempts and blocks its key), any event is nacked with probability 4%; a nacked
# keyed event takes the later events of its key in the batch with it (the relay releases them).
# c1 abandons one batch; a reclaim session moves it to proto.retry once it is older than 1 s.
# Every hand-out and settlement is logged with a number taken under one advisory lock just before
# its transaction commits, so the numbers follow commit order.
if [[ -z $only || $only == keys || $only == 5 ]]; then
echo
echo "== 5. correctness with keys and retries"
q -d proto_ao <<'SQL'
SELECT proto.reset();
CREATE SEQUENCE chk.kseq;
CREATE TABLE chk.kout (seq bigint, claimer text, token bigint, ord bigint, id bigint, from_retry boolean);
CREATE TABLE chk.kset (seq bigint, kind text, id bigint);
TRUNCATE chk.flag;
SQL
kproducer() { # n
  cat <<SQL
SET statement_timeout = '180s';
DO \$\$
DECLARE k text;
BEGIN
  FOR t IN 1..250 LOOP
    k := CASE WHEN random() < 0.2 THEN NULL ELSE 'k' || floor(random() * 50)::int END;
    -- The key's lock before the first write: the txid is drawn after it (see check (d)).
    IF k IS NOT NULL THEN PERFORM pg_advisory_xact_lock(hashtextextended('kchk/' || k, 0)); END IF;
    INSERT INTO proto.event_data (topic, event_key, payload)
    SELECT 'kchk', k, jsonb_build_object('p', $1, 't', t, 'g', g, 'poison', k IS NOT NULL AND random() < 0.003)
      FROM generate_series(1, 1 + floor(random() * 3)::int) g;
    PERFORM pg_sleep(random() * 0.01);
    IF t % 17 = 0 THEN ROLLBACK; ELSE COMMIT; END IF;
  END LOOP;
END \$\$;
SQL
}
# The log entry of this transaction: "kind" for ids, numbered under the lock, just before COMMIT.
klog() { # kind ids-expression
  echo "PERFORM pg_advisory_xact_lock(4242); s := nextval('chk.kseq');
        INSERT INTO chk.kset SELECT s, '$1', unnest($2);"
}
kclaimer() { # name abandon_at (the n-th claim with keyed events is abandoned; 0: never) [claim size]
  cat <<SQL
SET statement_timeout = '90s';
SET proto.backoff_ms = 20;  -- backoffs of 20, 80, 180 ms: dead letters within the run
CREATE TEMP TABLE got (ord bigint, token bigint, id bigint, event_key text, from_retry boolean, is_bad boolean);
DO \$\$
DECLARE s bigint; tok bigint; bad bigint[]; good bigint[]; idle int := 0; keyed int := 0;
BEGIN
  LOOP
    DELETE FROM got;
    INSERT INTO got
    SELECT c.ordinality, c.token, c.id, c.event_key, c.from_retry,
           (c.payload->>'poison')::boolean OR random() < 0.04
      FROM proto.claim('$1', ${3:-20}) WITH ORDINALITY c;
    PERFORM pg_advisory_xact_lock(4242); s := nextval('chk.kseq');
    INSERT INTO chk.kout SELECT s, '$1', g.token, g.ord, g.id, g.from_retry FROM got g;
    COMMIT;
    SELECT max(token) INTO tok FROM got;
    IF tok IS NULL THEN
      idle := idle + 1;
      -- Done: producers finished, nothing fresh, nothing in flight, nothing in proto.retry but
      -- dead letters and the events behind them.
      EXIT WHEN idle > 30 AND EXISTS (SELECT 1 FROM chk.flag) AND NOT EXISTS (SELECT 1 FROM proto.batch)
        AND NOT EXISTS (SELECT 1 FROM proto.retry r WHERE r.status <> 'FAIL'
                          AND NOT EXISTS (SELECT 1 FROM proto.retry f WHERE f.status = 'FAIL'
                                             AND f.topic = r.topic AND f.event_key = r.event_key AND f.id < r.id));
      PERFORM pg_sleep(0.01);
      CONTINUE;
    END IF;
    idle := 0;
    IF EXISTS (SELECT 1 FROM got WHERE event_key IS NOT NULL) THEN keyed := keyed + 1; END IF;
    CONTINUE WHEN keyed = $2 AND EXISTS (SELECT 1 FROM got WHERE event_key IS NOT NULL);  -- abandoned
    -- A bad event takes the later events of its key in the batch with it.
    bad := ARRAY(SELECT g.id FROM got g WHERE EXISTS (
                   SELECT 1 FROM got f WHERE f.is_bad AND f.ord <= g.ord
                      AND (f.id = g.id OR f.event_key = g.event_key)));
    good := ARRAY(SELECT g.id FROM got g WHERE g.id <> ALL (bad));
    IF bad <> '{}' THEN
      PERFORM proto.nack('$1', tok, bad, 'chk');
      $(klog nack bad)
      COMMIT;
    END IF;
    IF good <> '{}' THEN
      PERFORM proto.ack('$1', tok, good);
      $(klog ack good)
      COMMIT;
    END IF;
  END LOOP;
END \$\$;
SQL
}
kreclaimer() {
  cat <<SQL
SET statement_timeout = '90s';
DO \$\$
DECLARE s bigint; ids bigint[];
BEGIN
  LOOP
    -- What the reclaim will move (nothing else is older than a second), logged with it.
    ids := ARRAY(SELECT unnest(pending || retried) FROM proto.batch WHERE claimed_at < clock_timestamp() - interval '1.5 s');
    IF ids <> '{}' THEN
      IF proto.reclaim('1.5 s') <> cardinality(ids) THEN RAISE EXCEPTION 'reclaim moved a different set'; END IF;
      $(klog reclaim ids)
      COMMIT;
      EXIT;
    END IF;
    PERFORM pg_sleep(0.1);  -- until c1's abandoned batch is old enough
  END LOOP;
END \$\$;
SQL
}
kclaimer c1 12 | q -d proto_ao & c1=$!
kclaimer c2 0 | q -d proto_ao & c2=$!
kreclaimer | q -d proto_ao & rc=$!
kproducer 1 | q -d proto_ao & p1=$!
kproducer 2 | q -d proto_ao & p2=$!
kproducer 3 | q -d proto_ao & p3=$!
bg_pids+=("$c1" "$c2" "$rc" "$p1" "$p2" "$p3")
wait "$p1" "$p2" "$p3"
q -d proto_ao -c "INSERT INTO chk.flag VALUES (true)"
wait "$c1" "$c2" "$rc" || fail "(d)-(h) a claimer or the reclaimer failed (see the errors above)"
IFS='|' read -r produced keyed_n outs order_bad hol_bad fail_keys behind_fail after_fail lost phantom \
  unkeyed_bad diverted nacked reclaimed by1 by2 in_retry_wait <<<"$(q -d proto_ao <<'SQL'
WITH ev AS (SELECT id, event_key FROM proto.event_data),
     firsts AS (SELECT DISTINCT ON (id) id, seq, ord, from_retry FROM chk.kout ORDER BY id, seq, ord),
     dead AS (SELECT r.id, r.event_key, (SELECT max(s.seq) FROM chk.kset s WHERE s.id = r.id AND s.kind = 'nack') AS died
                FROM proto.retry r WHERE r.status = 'FAIL'),
     settled_before AS (SELECT id, min(seq) AS acked FROM chk.kset WHERE kind = 'ack' GROUP BY id)
SELECT (SELECT count(*) FROM ev),
       (SELECT count(*) FROM ev WHERE event_key IS NOT NULL),
       (SELECT count(*) FROM chk.kout),
       -- (d) per key, first hand-outs in id (= commit) order, and none before an earlier one
       --     that is never handed out
       (SELECT count(*) FROM (SELECT f.id, max(f.id) OVER (PARTITION BY e.event_key ORDER BY f.seq, f.ord
                                     ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS m
                                FROM firsts f JOIN ev e USING (id) WHERE e.event_key IS NOT NULL) s WHERE s.id < s.m)
       + (SELECT count(*) FROM ev e WHERE e.event_key IS NOT NULL AND NOT EXISTS (SELECT 1 FROM firsts f WHERE f.id = e.id)
             AND EXISTS (SELECT 1 FROM ev l JOIN firsts f USING (id) WHERE l.event_key = e.event_key AND l.id > e.id)),
       -- (e) every hand-out: each earlier event of its key was acked before, or rides in the same batch
       (SELECT count(*) FROM chk.kout o JOIN ev e USING (id)
         WHERE e.event_key IS NOT NULL
           AND EXISTS (SELECT 1 FROM ev x WHERE x.event_key = e.event_key AND x.id < e.id
                          AND NOT EXISTS (SELECT 1 FROM settled_before a WHERE a.id = x.id AND a.acked < o.seq)
                          AND NOT EXISTS (SELECT 1 FROM chk.kout y WHERE y.id = x.id AND y.token = o.token))),
       -- (f) dead heads: their keys, the events behind them, and hand-outs of those after the death
       (SELECT count(DISTINCT event_key) FROM dead),
       (SELECT count(*) FROM ev e JOIN dead d ON d.event_key = e.event_key AND e.id > d.id),
       (SELECT count(*) FROM chk.kout o JOIN ev e USING (id) JOIN dead d ON d.event_key = e.event_key
         WHERE e.id > d.id AND o.seq > d.died),
       -- (g) nothing lost: acked, dead, or behind a dead head of its key; none from a rolled-back transaction
       (SELECT count(*) FROM ev e WHERE NOT EXISTS (SELECT 1 FROM settled_before a WHERE a.id = e.id)
           AND NOT EXISTS (SELECT 1 FROM dead d WHERE d.id = e.id OR (d.event_key = e.event_key AND e.id > d.id))),
       (SELECT count(*) FROM chk.kout o WHERE NOT EXISTS (SELECT 1 FROM ev e WHERE e.id = o.id)),
       -- (h) unkeyed events: every one acked, and from proto.retry only after its own nack or reclaim
       (SELECT count(*) FROM ev e WHERE e.event_key IS NULL AND NOT EXISTS (SELECT 1 FROM settled_before a WHERE a.id = e.id))
       + (SELECT count(*) FROM chk.kout o JOIN ev e USING (id) WHERE e.event_key IS NULL AND o.from_retry
             AND NOT EXISTS (SELECT 1 FROM chk.kset s WHERE s.id = o.id AND s.kind IN ('nack', 'reclaim') AND s.seq < o.seq)),
       -- what the run exercised
       (SELECT count(*) FROM firsts WHERE from_retry),
       (SELECT count(*) FROM chk.kset WHERE kind = 'nack'),
       (SELECT count(*) FROM chk.kset WHERE kind = 'reclaim'),
       (SELECT count(*) FROM chk.kout WHERE claimer = 'c1'),
       (SELECT count(*) FROM chk.kout WHERE claimer = 'c2'),
       (SELECT count(*) FROM proto.retry WHERE status = 'WAIT')
SQL
)"
echo "   $produced events committed ($keyed_n keyed over 50 keys), $outs hand-outs (c1 $by1, c2 $by2); $nacked nacks, $reclaimed reclaimed, $diverted first hand-outs from proto.retry (diverted: busy key)"
check "$([ "$order_bad" = 0 ] && echo 1)" "(d) per key, the first hand-outs follow commit order ($order_bad out of order or passed over)"
check "$([ "$hol_bad" = 0 ] && echo 1)" "(e) no keyed event handed out before every earlier event of its key was acked or in the same batch ($hol_bad)"
check "$([ "$fail_keys" -gt 0 ] && [ "$after_fail" = 0 ] && echo 1)" \
  "(f) $fail_keys keys blocked by a dead head ($behind_fail events wait behind them): none handed out after the death ($after_fail)"
check "$([ "$lost" = 0 ] && [ "$phantom" = 0 ] && echo 1)" "(g) none lost ($lost neither acked nor dead nor behind a dead head) and none from a rolled-back transaction ($phantom)"
check "$([ "$unkeyed_bad" = 0 ] && echo 1)" "(h) unkeyed events all acked, and retried only after their own nack or reclaim ($unkeyed_bad)"
check "$([ "$diverted" -gt 0 ] && [ "$nacked" -gt 0 ] && [ "$reclaimed" -gt 0 ] && [ "$by1" -gt 0 ] && [ "$by2" -gt 0 ] && echo 1)" \
  "(d)-(h) exercised: diversions ($diverted), nacks ($nacked), a reclaim ($reclaimed events), both claimers"
# (i) Producers that draw their txid BEFORE the key lock (an application that writes its order
# row, then enqueues): within a key, id is still commit order but txid is not, and the cursor walks
# (txid, id). First a forced pair: T0 draws its txid, then waits for the key's lock held by T1
# (higher txid), which commits first; claims of 1. Then 4 such producers over 4 keys, drained by
# the two claimers of (d)-(h) with claims of 1 to 3 (cuts inside a window), nacks included.
q -d proto_ao -c "SELECT proto.reset()" >/dev/null
lock="SELECT pg_advisory_xact_lock(hashtextextended('lim/k', 0))"
PGAPPNAME=proto_ao_t0 q -d proto_ao -c "BEGIN" -c "SELECT pg_current_xact_id()" -c "SELECT pg_sleep(1)" -c "$lock" \
  -c "INSERT INTO proto.event_data (topic, event_key, payload) VALUES ('lim', 'k', '\"committed second\"')" -c "COMMIT" >/dev/null &
t0=$!; bg_pids+=("$t0")
until [ "$(q -d proto_ao -c "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'proto_ao_t0' AND backend_xid IS NOT NULL")" = 1 ]; do sleep 0.05; done
q -d proto_ao -c "BEGIN" -c "$lock" \
  -c "INSERT INTO proto.event_data (topic, event_key, payload) VALUES ('lim', 'k', '\"committed first\"')" \
  -c "SELECT pg_sleep(2)" -c "COMMIT" >/dev/null
wait "$t0"
handed=$(q -d proto_ao 2>&1 >/dev/null <<'SQL' | sed -nE 's/^NOTICE: +//p'
DO $$
DECLARE tok bigint; ids bigint[]; p text; got text[] := '{}';
BEGIN
  FOR i IN 1..4 LOOP  -- claims 1-2 divert both (to proto.retry, in id order), claims 3-4 hand them out
    SELECT max(token), array_agg(id), max(payload #>> '{}') INTO tok, ids, p FROM proto.claim('lim', 1);
    COMMIT;
    CONTINUE WHEN tok IS NULL;
    got := got || p;
    PERFORM proto.ack('lim', tok, ids);
    COMMIT;
  END LOOP;
  RAISE NOTICE '%', array_to_string(got, ', ');
END $$;
SQL
)
check "$([ "$handed" = "committed first, committed second" ] && echo 1)" \
  "(i) txid drawn before the key lock, claims of 1: handed out \"$handed\" (commit order: first, second)"
q -d proto_ao -c "SELECT proto.reset()" -c "TRUNCATE chk.kout, chk.kset, chk.flag" >/dev/null
iproducer() {
  cat <<'SQL'
SET statement_timeout = '120s';
DO $$
DECLARE k text;
BEGIN
  FOR t IN 1..150 LOOP
    k := 'k' || floor(random() * 4)::int;
    PERFORM pg_current_xact_id();  -- the txid first, then the key's lock
    PERFORM pg_sleep(random() * 0.004);
    PERFORM pg_advisory_xact_lock(hashtextextended('ichk/' || k, 0));
    INSERT INTO proto.event_data (topic, event_key, payload)
    SELECT 'ichk', k, '{}' FROM generate_series(1, 1 + floor(random() * 2)::int);
    PERFORM pg_sleep(random() * 0.004);
    COMMIT;
  END LOOP;
END $$;
SQL
}
kclaimer c1 0 "1 + floor(random() * 3)::int" | q -d proto_ao & c1=$!
kclaimer c2 0 "1 + floor(random() * 3)::int" | q -d proto_ao & c2=$!
pids=()
for _ in 1 2 3 4; do iproducer | q -d proto_ao & pids+=($!); done
bg_pids+=("$c1" "$c2" "${pids[@]}")
wait "${pids[@]}"
q -d proto_ao -c "INSERT INTO chk.flag VALUES (true)"
wait "$c1" "$c2" || fail "(i) a claimer failed (see the errors above)"
IFS='|' read -r i_n i_inv i_order i_hol i_lost i_twice i_div <<<"$(q -d proto_ao <<'SQL'
WITH ev AS (SELECT id, txid, event_key FROM proto.event_data),
     firsts AS (SELECT DISTINCT ON (id) id, seq, ord, from_retry FROM chk.kout ORDER BY id, seq, ord),
     acked AS (SELECT id, min(seq) AS acked, count(*) AS n FROM chk.kset WHERE kind = 'ack' GROUP BY id)
SELECT (SELECT count(*) FROM ev),
       -- pairs of one key whose txid order is not their id (commit) order
       (SELECT count(*) FROM ev a JOIN ev b ON a.event_key = b.event_key AND a.id < b.id AND a.txid > b.txid),
       -- as (d): per key, first hand-outs in id order
       (SELECT count(*) FROM (SELECT f.id, max(f.id) OVER (PARTITION BY e.event_key ORDER BY f.seq, f.ord
                                     ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS m
                                FROM firsts f JOIN ev e USING (id)) s WHERE s.id < s.m),
       -- as (e): each earlier event of the key acked before, or in the same batch
       (SELECT count(*) FROM chk.kout o JOIN ev e USING (id)
         WHERE EXISTS (SELECT 1 FROM ev x WHERE x.event_key = e.event_key AND x.id < e.id
                          AND NOT EXISTS (SELECT 1 FROM acked a WHERE a.id = x.id AND a.acked < o.seq)
                          AND NOT EXISTS (SELECT 1 FROM chk.kout y WHERE y.id = x.id AND y.token = o.token))),
       (SELECT count(*) FROM ev e WHERE NOT EXISTS (SELECT 1 FROM acked a WHERE a.id = e.id)
           AND NOT EXISTS (SELECT 1 FROM proto.retry r WHERE r.status = 'FAIL' AND r.event_key = e.event_key AND r.id <= e.id)),
       (SELECT count(*) FROM acked WHERE n > 1),
       (SELECT count(*) FROM firsts WHERE from_retry)
SQL
)"
echo "   $i_n events over 4 keys, $i_inv pairs of one key with txid order against commit order, $i_div hand-outs from proto.retry"
check "$([ "$i_inv" -gt 0 ] && [ "$i_order" = 0 ] && [ "$i_hol" = 0 ] && echo 1)" \
  "(i) txid drawn before the key lock, claims of 1-3: first hand-outs in commit order ($i_order), none before an earlier event of its key was acked ($i_hol)"
check "$([ "$i_lost" = 0 ] && [ "$i_twice" = 0 ] && echo 1)" "(i) none lost ($i_lost), none acked twice ($i_twice)"
fi  # section 5

# ---------------------------------------------------------------------------------------------
# 6. Keys: what a claim costs. $events events in 1,000 transactions over 1, 10,000 and 100,000
# keys (and none), vacuumed; one claim of $batch under EXPLAIN (ANALYZE, BUFFERS), then the drain
# of the rest (claim + ack, each committed, as section 3). Then the busy-key check's cost with
# batches in flight, a hot key's diversions, and the WAL of a life over 10,000 keys.
if [[ -z $only || $only == keys || $only == 6 ]]; then
keyed_drain() { # model size -> "buffers|ms of the first claim|ev/s of the drain of the rest"
  notices "${dbof[$1]}" <<SQL
DO \$\$
DECLARE j json; t0 timestamptz; tok bigint; ids bigint[]; n int := 0; b int; ms numeric;
BEGIN
$(explained_claim "$1" "$2")
  b := $buffers; ms := round((j->0->>'Execution Time')::numeric, 2); n := 0;
  t0 := clock_timestamp();
$(drain_loop "$1" "$2")
  IF n <> $events - $2 THEN RAISE EXCEPTION 'drained % of % events', n, $events - $2; END IF;
  RAISE NOTICE '%|%|%', b, ms, round(n / extract(epoch FROM clock_timestamp() - t0));
END \$\$;
SQL
}
declare -A kcost
for nk in 1 10000 100000; do  # unkeyed: section 3
  key="'k' || (g % $nk)"
  for m in P C; do
    backlog $m "$events" 1000 "$key"
    kcost[$m$nk]=$(keyed_drain $m "$batch")
    [ -n "${kcost[$m$nk]}" ] || fail "keyed drain ${label[$m]}, $nk keys failed (see the errors above)"
  done
done
# The busy-key check with unsettled batches: 10,000 keys, 4 claims of $batch not acked, then a
# 5th under EXPLAIN (its keys are not busy: the check's cost, no diversion). Then a hot key: one
# key, a batch in flight: the next claim moves its whole window to proto.retry, and so does
# every claim while the key has rows there; drained with 2 batches in flight.
busy_cost() { # -> "buffers|ms" of the 5th claim
  notices proto_ao <<SQL
DO \$\$
DECLARE j json; tok bigint; ids bigint[];
BEGIN
  FOR i IN 1..4 LOOP PERFORM proto.claim('inflight', $batch); COMMIT; END LOOP;
  EXECUTE 'EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT * FROM proto.claim(''bench'', $batch)' INTO j;
  RAISE NOTICE '%|%', $buffers, round((j->0->>'Execution Time')::numeric, 2);
END \$\$;
SQL
}
backlog P "$events" 1000 "'k' || (g % 10000)"
IFS='|' read -r busy_b busy_ms <<<"$(busy_cost)"
# Pipelined drain: a claim while the previous batch is still unacked, as a relay that overlaps
# publishing with claiming does. NOTICE "<first diverting claim's buffers>|<its ms>|<events>|<ev/s>".
pipelined() {
  notices proto_ao <<SQL
DO \$\$
DECLARE j json; t0 timestamptz; tok bigint; ids bigint[]; prev_tok bigint; prev_ids bigint[];
        n int := 0; b int; ms numeric; moved bigint;
BEGIN
  $(claim_sql P "$batch");
  n := cardinality(ids); prev_tok := tok; prev_ids := ids;
  COMMIT;
  EXECUTE 'EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT * FROM proto.claim(''bench'', $batch)' INTO j;
  b := $buffers; ms := round((j->0->>'Execution Time')::numeric, 2);
  COMMIT;
  -- What the measured claim handed out (if anything) is settled in the loop, after prev.
  SELECT token, pending || retried INTO tok, ids FROM proto.batch WHERE owner = 'bench' AND token > prev_tok;
  IF ids IS NOT NULL THEN
    PERFORM proto.ack('bench', prev_tok, prev_ids); COMMIT;
    n := n + cardinality(ids); prev_tok := tok; prev_ids := ids;
  END IF;
  t0 := clock_timestamp();
  LOOP
    EXIT WHEN clock_timestamp() > t0 + interval '30 s';  -- a slow path: report what it did in 30 s
    $(claim_sql P "$batch");
    COMMIT;
    IF prev_ids IS NOT NULL THEN PERFORM proto.ack('bench', prev_tok, prev_ids); COMMIT; END IF;
    EXIT WHEN ids IS NULL AND prev_ids IS NULL AND NOT EXISTS (SELECT 1 FROM proto.retry);
    n := n + coalesce(cardinality(ids), 0);
    prev_tok := tok; prev_ids := ids;
  END LOOP;
  SELECT n_tup_ins INTO moved FROM pg_stat_user_tables WHERE relid = 'proto.retry'::regclass;
  RAISE NOTICE '%|%|%|%', b, ms, n, round(n / extract(epoch FROM clock_timestamp() - t0));
END \$\$;
SQL
}
backlog P "$events" 1000 "'k1'"
l0=$(lsn)
IFS='|' read -r hot_b hot_ms hot_n hot_rate <<<"$(pipelined)"
read -r hot_wal _ <<<"$(wal_of P "$l0" "$(lsn)")"
[ -n "$hot_n" ] || fail "pipelined drain of one key failed (see the errors above)"
backlog P "$events" 1000 "'k' || (g % 10000)"
l0=$(lsn)
IFS='|' read -r _ _ many_n many_rate <<<"$(pipelined)"
read -r many_wal _ <<<"$(wal_of P "$l0" "$(lsn)")"
[ -n "$many_n" ] || fail "pipelined drain of 10,000 keys failed (see the errors above)"
wal_life_run P PK "'k' || (g % 10000)"
wal_life_run C CK "'k' || (g % 10000)"

echo
echo "== 6. keys: a claim of $batch (buffers hit+read, ms: EXPLAIN ANALYZE BUFFERS) and the drain of the rest (ev/s)"
echo "   $events events in 1,000 transactions, vacuumed; drain: claim $batch + ack, each committed"
printf '%-8s | %-26s | %-26s\n' "" prototype "outbox $current"
printf '%-8s |%s|%s\n' keys "$(printf ' %7s %7s %10s ' buf ms "ev/s")" "$(printf ' %7s %7s %10s ' buf ms "ev/s")"
for nk in 1 10000 100000; do
  IFS='|' read -r pb pm pr <<<"${kcost[P$nk]}"; IFS='|' read -r cb cm cr <<<"${kcost[C$nk]}"
  printf '%-8s | %7s %7s %10s | %7s %7s %10s\n' "$nk" "$pb" "$pm" "$pr" "$cb" "$cm" "$cr"
done
echo "   prototype, 10,000 keys, 4 batches of $batch unsettled: the next claim (no busy key among its events)"
echo "   touches $busy_b buffers ($busy_ms ms)"
echo "   prototype, 1 key, its previous batch unsettled: the next claim moves its window to proto.retry:"
echo "   $hot_b buffers ($hot_ms ms); drained with 2 batches in flight (at most 30 s): $hot_n events at $hot_rate ev/s,"
echo "   $(per "${hot_wal:-0}" "${hot_n:-1}") B WAL/event; 10,000 keys, the same pipelined drain: $many_n events at $many_rate ev/s,"
echo "   $(per "${many_wal:-0}" "${many_n:-1}") B WAL/event"
echo
echo "   WAL bytes per event over a life, $events events over 10,000 keys, one per transaction (as section 2)"
row() { printf '%-14s %7s %9s %9s %6s %5s %8s | %8s\n' "$@"; }
row model enqueue claim+ack retention life FPI "lsn life" life-run
for m in P C; do
  row "${label[$m]}" "${wal_enq[${m}K]}" "${wal_drain[${m}K]}" "${wal_ret[${m}K]}" "${wal_life[${m}K]}" \
    "${fpi_life[${m}K]}" "${lsn_life[${m}K]}" "${life_rate[${m}K]}"
done
fi  # section 6

echo
if [ $failed = 0 ]; then echo "all checks PASS"; else echo "some checks FAILED"; exit 1; fi
