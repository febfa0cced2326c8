-- Data model of the outbox (docs/reference.md, "Data model"). Every object carries the outbox_
-- prefix and lives in the extension's schema.

CREATE TYPE @extschema@.outbox_status AS ENUM ('WAIT', 'SENDING', 'SUCCESS', 'FAIL');

-- Plain sequences (not identity columns) so pg_extension_config_dump can register them: a restored
-- database must keep issuing ids and fencing tokens above the ones it already holds.
CREATE SEQUENCE @extschema@.outbox_event_id_seq AS bigint;
CREATE SEQUENCE @extschema@.outbox_claim_token_seq AS bigint;

-- Events whose state lives in their row: due later (deliver_at), or stream events after a failed
-- attempt or whose key was busy (docs/design.md). Fresh events go to outbox_stream instead; the
-- view outbox_event shows both.
CREATE TABLE @extschema@.outbox_scheduled (
    id              bigint PRIMARY KEY DEFAULT nextval('@extschema@.outbox_event_id_seq'),
    topic           text NOT NULL,
    event_key       text,
    event_type      text,
    payload         jsonb NOT NULL,
    headers         jsonb NOT NULL DEFAULT '{}',
    status          @extschema@.outbox_status NOT NULL,
    retry_count     int NOT NULL DEFAULT 0,
    next_retry_time timestamptz NOT NULL,
    claim_owner     text,
    claim_token     bigint,
    claimed_at      timestamptz,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    -- The event's global identity, sent as the event_id header: consumers dedupe on it. The
    -- bigint id is only this table's key; a restore, a sequence reset or a second database
    -- publishing to the same topic reissues ids, never UUIDs.
    event_id        uuid NOT NULL DEFAULT @extschema@.outbox_uuidv7(),
    -- Whether the event keeps its key's order (a key, and a topic not in outbox.unordered_topics),
    -- decided at enqueue. Ordered events are claimed through outbox_key, the rest directly.
    ordered         boolean NOT NULL DEFAULT false,
    -- An operator skipped this dead letter (outbox_skip): it no longer holds its key.
    skipped_at      timestamptz
) WITH (
    -- A queue table churns: vacuum and analyze it long before the default 20 % of dead rows.
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02,
    -- Half of each page stays free for the versions a claim and an ack write: on the same page
    -- the WAL logs only their changed bytes, not the payload again, and no extra lock record for
    -- a version that moves (docs/reference.md, "Life-cycle cost").
    fillfactor = 50
);
ALTER SEQUENCE @extschema@.outbox_event_id_seq OWNED BY @extschema@.outbox_scheduled.id;

-- Hot path 1: due unordered WAIT rows, oldest next_retry_time first (outbox_claim). Partial, so
-- its size follows the backlog, not the history of SUCCESS rows (reports/INDEXES.md).
CREATE INDEX outbox_scheduled_wait_due_idx
    ON @extschema@.outbox_scheduled (next_retry_time, id) WHERE status = 'WAIT' AND NOT ordered;
-- Hot path 1, ordered: a key's unfinished events in commit (= id) order; its first entry is the
-- key's head. Claim cost follows the keys it visits, not a hot key's backlog.
CREATE INDEX outbox_scheduled_key_pending_idx
    ON @extschema@.outbox_scheduled (topic, event_key, id) WHERE ordered AND status <> 'SUCCESS';
-- Hot path 2: leases by age (outbox_reclaim, outbox_stats).
CREATE INDEX outbox_scheduled_sending_claimed_idx
    ON @extschema@.outbox_scheduled (claimed_at) WHERE status = 'SENDING';
-- Dead letters for operators (outbox_dead_letters, outbox_stats); FAIL rows are few.
CREATE INDEX outbox_scheduled_fail_idx
    ON @extschema@.outbox_scheduled (id) WHERE status = 'FAIL';

-- Purge: delivered rows by age, so a purge reads the rows it deletes, not the whole history.
CREATE INDEX outbox_scheduled_success_updated_idx
    ON @extschema@.outbox_scheduled (updated_at) WHERE status = 'SUCCESS';

-- What a claim does next with a key (outbox_key.state; docs/design.md has the table): look at its
-- head at due_at, wait for its run's lease, for a stream batch holding the key, for an operator
-- (a dead head), or delete the row (nothing unfinished).
CREATE TYPE @extschema@.outbox_key_state AS ENUM ('waiting', 'running', 'held', 'blocked', 'idle');

-- One row per key whose ordered events are in row state (docs/design.md): created when its first
-- event becomes a scheduled row, deleted by a claim once the key has nothing unfinished.
CREATE TABLE @extschema@.outbox_key (
    topic     text NOT NULL,
    event_key text NOT NULL,
    state     @extschema@.outbox_key_state NOT NULL,
    -- When a claim looks at the key next; a blocked key waits for an operator, not a time.
    due_at    timestamptz CHECK ((due_at IS NULL) = (state = 'blocked')),
    PRIMARY KEY (topic, event_key)
) WITH (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02
);
CREATE INDEX outbox_key_due_idx ON @extschema@.outbox_key (due_at);
-- The few keys in the states operators and claims look up by state.
CREATE INDEX outbox_key_state_idx ON @extschema@.outbox_key (state)
    WHERE state IN ('held', 'blocked', 'idle');

-- Fresh events due now, append-only: inserted by outbox_enqueue, never updated, deleted by
-- outbox_purge. Claims hand them out through outbox_stream_cursor and record each claim as one
-- outbox_stream_batch row, so an event's row is written once and no claim walks dead entries.
CREATE TABLE @extschema@.outbox_stream (
    id          bigint PRIMARY KEY DEFAULT nextval('@extschema@.outbox_event_id_seq'),
    -- The inserting top-level transaction (not xmin: an insert in a savepoint has a
    -- subtransaction's xmin, which no snapshot lists as in progress).
    txid        xid8 NOT NULL DEFAULT pg_catalog.pg_current_xact_id(),
    topic       text NOT NULL,
    event_key   text,
    -- outbox_key_hash(topic, event_key) for an ordered event (it keeps its key's order), NULL for
    -- the rest: claims compare keys by it (a collision only makes a key look busy: safe).
    key_hash    bigint,
    event_type  text,
    payload     jsonb NOT NULL,
    headers     jsonb NOT NULL DEFAULT '{}',
    created_at  timestamptz NOT NULL DEFAULT now(),
    event_id    uuid NOT NULL DEFAULT @extschema@.outbox_uuidv7()
) WITH (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02
);
-- A window's bounds and a long transaction's events, by txid (outbox_stream_window, _walk); the
-- walk itself goes by primary key.
CREATE INDEX outbox_stream_txid_idx ON @extschema@.outbox_stream (txid, id);

-- The stream's read position (outbox_stream_passed says what it has handed out), one version per
-- claim that moved it, the newest counting: appended, not updated, so a long snapshot never makes
-- the newest expensive to find. Claims take turns on it with an advisory lock.
CREATE TABLE @extschema@.outbox_stream_cursor (
    version   bigint PRIMARY KEY,
    prev_snap pg_snapshot NOT NULL,
    cur_snap  pg_snapshot NOT NULL,
    pos_id    bigint NOT NULL,
    -- The window's bounds (outbox_stream_window): win_lo NULL when no transaction begun after
    -- prev_snap has events in it.
    win_lo    bigint,
    win_hi    bigint NOT NULL,
    -- The largest stream id when cur_snap was taken: every event cur_snap sees has an id at most
    -- this (see outbox_stream_take, a cursor restored into another cluster).
    id_hwm    bigint NOT NULL DEFAULT 0,
    -- No unsettled outbox_stream_batch has a claim token below this one. Claims read the batches
    -- from it on, by primary key: a held snapshot keeps one dead batch row per settled claim, and
    -- reading them all made every claim slower the longer the snapshot was held.
    batch_floor bigint NOT NULL DEFAULT 0
);
-- The current snapshot as another session would take it, listing this transaction (if it has an
-- id) as in progress: else the cursor would pass events the claim's own transaction enqueues later.
-- PL/pgSQL, not SQL: a SQL function with a SET clause is parsed and planned at every call.
CREATE FUNCTION @extschema@.outbox_snapshot_of_others() RETURNS pg_snapshot
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    RETURN (SELECT CASE WHEN c.me IS NOT NULL AND c.me < pg_snapshot_xmax(c.snap)
                        THEN format('%s:%s:%s', least(pg_snapshot_xmin(c.snap), c.me), pg_snapshot_xmax(c.snap),
                                    array_to_string(ARRAY(SELECT x FROM pg_snapshot_xip(c.snap) x
                                                          UNION SELECT c.me ORDER BY 1), ','))::pg_snapshot
                        ELSE c.snap END
              FROM (SELECT pg_current_snapshot() AS snap, pg_current_xact_id_if_assigned() AS me) c);
END
$$;

-- The cursor's newest version, the one that counts. No SET clause, so the planner inlines it;
-- every object is named with its schema instead.
CREATE FUNCTION @extschema@.outbox_cursor() RETURNS SETOF @extschema@.outbox_stream_cursor
LANGUAGE sql STABLE
AS $$
    SELECT v.* FROM @extschema@.outbox_stream_cursor v ORDER BY v.version DESC LIMIT 1
$$;

-- The first window is empty and starts here: every transaction still running (this one
-- included) counts as unfinished, so an event it inserts later is still handed out.
INSERT INTO @extschema@.outbox_stream_cursor (version, prev_snap, cur_snap, pos_id, win_hi)
SELECT 1, n.snap, n.snap, 0, 0 FROM (SELECT @extschema@.outbox_snapshot_of_others() AS snap) n;

-- One row per claim that handed out stream events: the claim's owner, token and lease, and the
-- ids not yet settled. Acking the whole claim deletes the row.
CREATE TABLE @extschema@.outbox_stream_batch (
    claim_token bigint PRIMARY KEY,
    claim_owner text NOT NULL,
    claimed_at  timestamptz NOT NULL,
    pending     bigint[] NOT NULL,
    -- The key hashes of its ordered events: while it is unsettled those keys are busy, and a
    -- claim hands out no later event of them.
    keys        bigint[] NOT NULL DEFAULT '{}',
    -- A claim found a key's scheduled events waiting for this batch: settling it makes those keys due.
    waiters     boolean NOT NULL DEFAULT false
);

-- One row per claimer that beats (outbox_heartbeat): once its beat runs out, its claims are
-- reclaimed without waiting for the lease. A claimer that never beats has the lease alone.
-- Runtime state: not dumped; outbox_reclaim deletes owners gone for longer than a lease.
CREATE TABLE @extschema@.outbox_owner (
    owner      text PRIMARY KEY,
    -- Its first heartbeat since its row was last deleted.
    started_at timestamptz NOT NULL,
    beat_at    timestamptz NOT NULL,
    -- beat_at + the timeout the owner gave: past it, the owner counts as gone.
    expires_at timestamptz NOT NULL
);

-- Whether the cursor has handed out the event (txid, id): finished before prev_snap, or before
-- cur_snap with an id up to pos_id. No SET clause, so the planner inlines it; every function and
-- operator is named with its schema instead. (The view and the dump filter write it out.)
CREATE FUNCTION @extschema@.outbox_stream_passed(txid xid8, id bigint, prev_snap pg_snapshot,
                                                 cur_snap pg_snapshot, pos_id bigint)
RETURNS boolean
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT pg_catalog.pg_visible_in_snapshot(txid, prev_snap)
        OR (pg_catalog.pg_visible_in_snapshot(txid, cur_snap)
            AND id OPERATOR(pg_catalog.<=) pos_id)
$$;

-- What operators read: every event with one set of columns and statuses. A stream event is WAIT,
-- SENDING while a claim holds it, SUCCESS once settled (updated_at: its creation, never rewritten);
-- after a failed attempt its scheduled copy stands for it. Read-only.
CREATE VIEW @extschema@.outbox_event AS
SELECT t.id, t.topic, t.event_key, t.event_type, t.payload, t.headers, t.status, t.retry_count,
       t.next_retry_time, t.claim_owner, t.claim_token, t.claimed_at, t.last_error, t.created_at,
       t.updated_at, t.event_id, t.ordered, t.skipped_at
  FROM @extschema@.outbox_scheduled t
UNION ALL
SELECT s.id, s.topic, s.event_key, s.event_type, s.payload, s.headers,
       -- outbox_stream_passed, written out: a view's functions need its reader's EXECUTE.
       (CASE WHEN b.claim_token IS NOT NULL THEN 'SENDING'
             WHEN pg_catalog.pg_visible_in_snapshot(s.txid, c.prev_snap)
               OR (pg_catalog.pg_visible_in_snapshot(s.txid, c.cur_snap)
                   AND s.id <= c.pos_id) THEN 'SUCCESS'
             ELSE 'WAIT' END)::@extschema@.outbox_status,
       0, s.created_at, b.claim_owner, b.claim_token, b.claimed_at, NULL::text, s.created_at,
       coalesce(b.claimed_at, s.created_at), s.event_id, s.key_hash IS NOT NULL, NULL::timestamptz
  FROM @extschema@.outbox_stream s
 CROSS JOIN (SELECT v.prev_snap, v.cur_snap, v.pos_id
               FROM @extschema@.outbox_stream_cursor v ORDER BY v.version DESC LIMIT 1) c
  LEFT JOIN (SELECT pg_catalog.unnest(p.pending) AS id, p.claim_owner, p.claim_token, p.claimed_at
               FROM @extschema@.outbox_stream_batch p) b ON b.id = s.id
 WHERE NOT EXISTS (SELECT 1 FROM @extschema@.outbox_scheduled r WHERE r.id = s.id);

-- A stream row restored by pg_dump carries another database's txid, meaningless to this cursor:
-- it takes the restoring transaction's, so the restored events form one window, handed out in id
-- order. outbox_enqueue's rows never fire it.
CREATE FUNCTION @extschema@.outbox_stream_restamp() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    NEW.txid := pg_current_xact_id();
    RETURN NEW;
END
$$;
CREATE TRIGGER outbox_stream_restamp BEFORE INSERT ON @extschema@.outbox_stream
    FOR EACH ROW WHEN (NEW.txid IS DISTINCT FROM pg_catalog.pg_current_xact_id())
    EXECUTE FUNCTION @extschema@.outbox_stream_restamp();

-- pg_dump must carry the outbox: a restored database still owes its unpublished events. Only
-- during CREATE EXTENSION: the SQL-only build's tables are ordinary tables, dumped anyway.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_depend d
                WHERE d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass
                  AND d.objid = '@extschema@.outbox_scheduled'::pg_catalog.regclass AND d.deptype = 'e') THEN
        PERFORM pg_catalog.pg_extension_config_dump('@extschema@.outbox_scheduled', '');
        -- Stream events still owed (outbox_stream_passed written out, or in an unsettled claim)
        -- without a scheduled copy; the cursor and claims are not dumped: a fresh cursor hands
        -- them out.
        PERFORM pg_catalog.pg_extension_config_dump('@extschema@.outbox_stream',
            'WHERE NOT EXISTS (SELECT 1 FROM @extschema@.outbox_stream_cursor c'
            ' WHERE c.version = (SELECT pg_catalog.max(v.version) FROM @extschema@.outbox_stream_cursor v)'
            ' AND (pg_catalog.pg_visible_in_snapshot(txid, c.prev_snap)'
            ' OR (pg_catalog.pg_visible_in_snapshot(txid, c.cur_snap) AND id <= c.pos_id)))'
            ' AND NOT EXISTS (SELECT 1 FROM @extschema@.outbox_scheduled t WHERE t.id = outbox_stream.id)'
            ' OR EXISTS (SELECT 1 FROM @extschema@.outbox_stream_batch b WHERE id = ANY (b.pending))');
        PERFORM pg_catalog.pg_extension_config_dump('@extschema@.outbox_event_id_seq', '');
        PERFORM pg_catalog.pg_extension_config_dump('@extschema@.outbox_key', '');
        PERFORM pg_catalog.pg_extension_config_dump('@extschema@.outbox_claim_token_seq', '');
    END IF;
END
$$;
