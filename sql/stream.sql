-- The stream: fresh events handed out window by window (docs/design.md, "The claim path").

-- The advisory lock on which claims take turns to read the stream (outbox_stream_take); the high
-- 32 bits ('outb') keep it apart from an application's small advisory lock numbers.
CREATE FUNCTION @extschema@.outbox_stream_lock_id() RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT 8031453474740765696::pg_catalog.int8
$$;

-- Takes the stream's lock until commit (a position is only visible then): true once held, false
-- after a second behind another holder (a claim left open in a transaction), so that a claim
-- never stalls for long. An advisory lock writes no WAL: an idle poll writes nothing.
CREATE FUNCTION @extschema@.outbox_stream_lock() RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET lock_timeout = '1s'
AS $$
BEGIN
    IF pg_try_advisory_xact_lock(@extschema@.outbox_stream_lock_id()) THEN
        RETURN true;
    END IF;
    BEGIN -- the block's subtransaction only when the lock is taken
        PERFORM pg_advisory_xact_lock(@extschema@.outbox_stream_lock_id());
    EXCEPTION WHEN lock_not_available THEN
        RETURN false;
    END;
    RETURN true;
END
$$;

-- A cursor restored into another cluster, made good and replaced by a fresh one: events it owed
-- become scheduled rows due now, held ones stay their claim's; stream rows of txids this cluster has
-- not reached are deleted, never to be handed out again. Loud: such a restore re-delivers.
CREATE FUNCTION @extschema@.outbox_stream_rebase(c @extschema@.outbox_stream_cursor)
RETURNS @extschema@.outbox_stream_cursor
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    stamp timestamptz := clock_timestamp();
    owed_ids bigint[];
    held_ids bigint[];
BEGIN
    held_ids := ARRAY(SELECT unnest(b.pending) FROM @extschema@.outbox_stream_batch b);
    owed_ids := ARRAY(SELECT s.id FROM @extschema@.outbox_stream s
                       WHERE (s.id > c.id_hwm
                              OR NOT @extschema@.outbox_stream_passed(s.txid, s.id, c.prev_snap, c.cur_snap, c.pos_id))
                         AND NOT s.id = ANY (held_ids)
                         AND NOT EXISTS (SELECT 1 FROM @extschema@.outbox_scheduled t WHERE t.id = s.id));
    held_ids := ARRAY(SELECT h FROM unnest(held_ids) h
                       WHERE NOT EXISTS (SELECT 1 FROM @extschema@.outbox_scheduled t WHERE t.id = h));
    PERFORM @extschema@.outbox_stream_schedule(owed_ids, 'WAIT', 0, stamp, NULL, stamp);
    PERFORM @extschema@.outbox_stream_schedule(held_ids, 'SENDING', 0, stamp, NULL, stamp);
    UPDATE @extschema@.outbox_scheduled t
       SET claim_owner = b.claim_owner, claim_token = b.claim_token, claimed_at = b.claimed_at
      FROM @extschema@.outbox_stream_batch b
     WHERE t.id = ANY (held_ids) AND t.id = ANY (b.pending);
    PERFORM @extschema@.outbox_keys_wait(owed_ids || held_ids, stamp);
    DELETE FROM @extschema@.outbox_stream_batch;
    DELETE FROM @extschema@.outbox_stream s
     WHERE s.txid >= pg_snapshot_xmax(pg_current_snapshot())
        OR EXISTS (SELECT 1 FROM @extschema@.outbox_scheduled t WHERE t.id = s.id);
    RAISE WARNING USING
        MESSAGE = format('outbox: the stream''s cursor is ahead of this cluster''s transaction ids (a restore into another cluster?): %s events not yet handed out and %s held by a claim are now scheduled rows, delivered again; a fresh cursor starts',
                         cardinality(owed_ids), cardinality(held_ids));
    c.prev_snap := @extschema@.outbox_snapshot_of_others();
    c.cur_snap := c.prev_snap;
    c.pos_id := 0;
    c.win_lo := NULL;
    c.win_hi := 0;
    c.id_hwm := coalesce((SELECT max(e.id) FROM @extschema@.outbox_stream e), 0);
    RETURN c;
END
$$;

-- Stream events become scheduled rows (same id and event_id) whose state lives in their row from
-- then on: after a failed attempt (nack, reclaim), a release, a busy key, a restored cursor.
CREATE FUNCTION @extschema@.outbox_stream_schedule(ids bigint[], new_status @extschema@.outbox_status,
                                                attempts int, due timestamptz, error text,
                                                stamp timestamptz)
RETURNS TABLE (id bigint, topic text, status @extschema@.outbox_status, retry_count int,
               next_retry_time timestamptz)
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF cardinality(ids) > 0 THEN
        RETURN QUERY
        INSERT INTO @extschema@.outbox_scheduled AS m
            (id, topic, event_key, event_type, payload, headers, status, retry_count,
             next_retry_time, last_error, created_at, updated_at, event_id, ordered)
        SELECT s.id, s.topic, s.event_key, s.event_type, s.payload, s.headers, new_status, attempts,
               due, error, s.created_at, stamp, s.event_id, s.key_hash IS NOT NULL
          FROM @extschema@.outbox_stream s
         WHERE s.id = ANY (ids)
         ORDER BY s.id
        RETURNING m.id, m.topic, m.status, m.retry_count, m.next_retry_time;
    END IF;
END
$$;

-- The window between two snapshots (events cur_snap sees finished and prev_snap does not): lo, the
-- smallest id of transactions begun after prev_snap; hi, the largest of all. A transaction
-- prev_snap saw running costs a probe on txid, not a range. (PL/pgSQL: its plan is cached.)
CREATE FUNCTION @extschema@.outbox_stream_window(prev_snap pg_snapshot, cur_snap pg_snapshot,
                                                 OUT lo bigint, OUT hi bigint)
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    SELECT min(w.id) FILTER (WHERE w.newer), max(w.id) INTO lo, hi
      FROM (SELECT e.id, true AS newer FROM @extschema@.outbox_stream e
             WHERE e.txid >= pg_snapshot_xmax(prev_snap) AND e.txid < pg_snapshot_xmax(cur_snap)
               AND pg_visible_in_snapshot(e.txid, cur_snap)
            UNION ALL
            SELECT (SELECT max(e.id) FROM @extschema@.outbox_stream e WHERE e.txid = x), false
              FROM pg_snapshot_xip(prev_snap) x
             WHERE pg_visible_in_snapshot(x, cur_snap)) w;
END
$$;

-- Up to `need` events of the window after pos_id, in id order: by txid for transactions prev_snap
-- saw running, one primary-key range lo..hi for the rest. No SET clause, so the planner inlines it;
-- every function and operator is named with its schema instead.
CREATE FUNCTION @extschema@.outbox_stream_walk(prev_snap pg_snapshot, cur_snap pg_snapshot, pos_id bigint,
                                               lo bigint, hi bigint, need int)
RETURNS TABLE (id bigint, key_hash bigint)
LANGUAGE sql STABLE
AS $$
    SELECT w.id, w.key_hash FROM (
        SELECT e.id, e.key_hash
          FROM pg_catalog.pg_snapshot_xip(prev_snap) x
         CROSS JOIN LATERAL (SELECT e.id, e.key_hash FROM @extschema@.outbox_stream e
                              WHERE e.txid OPERATOR(pg_catalog.=) x AND e.id OPERATOR(pg_catalog.>) pos_id
                              ORDER BY e.txid, e.id LIMIT need) e
         WHERE pg_catalog.pg_visible_in_snapshot(x, cur_snap)
        UNION ALL
        (SELECT e.id, e.key_hash FROM @extschema@.outbox_stream e
          WHERE lo IS NOT NULL
            AND e.id OPERATOR(pg_catalog.>) greatest(pos_id, lo OPERATOR(pg_catalog.-) 1)
            AND e.id OPERATOR(pg_catalog.<=) hi
            AND e.txid OPERATOR(pg_catalog.>=) pg_catalog.pg_snapshot_xmax(prev_snap)
            AND pg_catalog.pg_visible_in_snapshot(e.txid, cur_snap)
          ORDER BY e.id
          LIMIT need)
    ) w
    ORDER BY w.id
    LIMIT need
$$;

-- Of a claim's stream events, those of busy keys (in an unsettled batch, or with a key row) go to
-- scheduled rows behind their key's head (key rows in key order); returns the rest. Their batches
-- learn that keys wait, and held keys are due now. Skips what is locked: never waits here.
CREATE FUNCTION @extschema@.outbox_stream_divert(INOUT ids bigint[], INOUT hashes bigint[],
                                                 stamp timestamptz, floor bigint)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    busy bigint[];
BEGIN
    -- In another unsettled batch (few rows), or with a key row (read only if any).
    busy := ARRAY(SELECT DISTINCT k FROM @extschema@.outbox_stream_batch b, unnest(b.keys) k
                   WHERE b.claim_token >= floor AND k = ANY (hashes));
    IF EXISTS (SELECT 1 FROM @extschema@.outbox_key) THEN
        busy := busy || ARRAY(SELECT DISTINCT s.key_hash FROM @extschema@.outbox_stream s
                                JOIN @extschema@.outbox_key k ON k.topic = s.topic AND k.event_key = s.event_key
                               WHERE s.id = ANY (ids) AND s.key_hash IS NOT NULL);
    END IF;
    IF cardinality(busy) = 0 THEN
        RETURN;
    END IF;
    PERFORM FROM @extschema@.outbox_stream_schedule(
        ARRAY(SELECT s.id FROM @extschema@.outbox_stream s WHERE s.id = ANY (ids) AND s.key_hash = ANY (busy)),
        'WAIT', 0, stamp, NULL, stamp);
    INSERT INTO @extschema@.outbox_key (topic, event_key, state, due_at)
    SELECT DISTINCT s.topic, s.event_key, 'waiting'::@extschema@.outbox_key_state, stamp
      FROM @extschema@.outbox_stream s
     WHERE s.id = ANY (ids) AND s.key_hash = ANY (busy)
       AND NOT EXISTS (SELECT 1 FROM @extschema@.outbox_key d
                        WHERE d.topic = s.topic AND d.event_key = s.event_key)
     ORDER BY 1, 2
    ON CONFLICT DO NOTHING;
    UPDATE @extschema@.outbox_key k SET state = 'waiting', due_at = stamp
      FROM (SELECT d.ctid AS row_id FROM @extschema@.outbox_key d
             WHERE d.state = 'held' AND @extschema@.outbox_key_hash(d.topic, d.event_key) = ANY (busy)
             FOR UPDATE SKIP LOCKED) w
     WHERE k.ctid = w.row_id;
    UPDATE @extschema@.outbox_stream_batch b SET waiters = true
     WHERE b.claim_token IN (SELECT o.claim_token FROM @extschema@.outbox_stream_batch o
                              WHERE o.claim_token >= floor AND o.keys && busy AND NOT o.waiters
                              FOR UPDATE SKIP LOCKED);
    SELECT coalesce(array_agg(t.id ORDER BY t.id), '{}'), coalesce(array_agg(t.h ORDER BY t.id), '{}')
      INTO ids, hashes
      FROM unnest(ids, hashes) t(id, h)
     WHERE (t.h = ANY (busy)) IS NOT TRUE;
END
$$;

-- The stream's part of a claim: up to max_events fresh events as this token's batch (PgQ's rule:
-- the window between two snapshots, in id order, then the next window; docs/design.md). Events of
-- busy keys go behind their key's work instead (outbox_stream_divert).
CREATE FUNCTION @extschema@.outbox_stream_take(owner text, token bigint, stamp timestamptz, max_events int)
RETURNS bigint[]
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_variable
DECLARE
    c @extschema@.outbox_stream_cursor;
    was text;
    ids bigint[] := '{}';
    hashes bigint[] := '{}';
    part_ids bigint[];
    part_hashes bigint[];
    fresh pg_snapshot;
    win record;
BEGIN
    IF NOT @extschema@.outbox_stream_lock() THEN
        RETURN '{}';
    END IF;
    -- A statement after the lock: its snapshot sees the last holder's position.
    SELECT * INTO c FROM @extschema@.outbox_cursor();
    was := c::text;
    -- A cursor ahead of this database's transaction ids was restored into another cluster (the
    -- SQL-only build's pg_dump carries it): its snapshots say nothing about the txids here.
    IF pg_snapshot_xmax(c.cur_snap) > pg_snapshot_xmax(pg_current_snapshot()) THEN
        c := @extschema@.outbox_stream_rebase(c);
        was := '';
    END IF;
    FOR w IN 1..2 LOOP
        -- Past win_hi, the window's largest id, the window is used up.
        IF c.pos_id < c.win_hi THEN
            SELECT array_agg(s.id ORDER BY s.id), array_agg(s.key_hash ORDER BY s.id)
              INTO part_ids, part_hashes
              FROM @extschema@.outbox_stream_walk(c.prev_snap, c.cur_snap, c.pos_id, c.win_lo, c.win_hi,
                                                  max_events - cardinality(ids)) s;
            IF part_ids IS NOT NULL THEN
                ids := ids || part_ids;
                hashes := hashes || part_hashes;
                c.pos_id := part_ids[cardinality(part_ids)];
            END IF;
        END IF;
        EXIT WHEN cardinality(ids) >= max_events OR w = 2;
        -- The window is used up: the next one ends at a fresh snapshot, taken now that the lock
        -- is held. An empty one is not kept (the next claim's window covers it), so a poll of an
        -- idle outbox writes nothing.
        fresh := @extschema@.outbox_snapshot_of_others();
        EXIT WHEN fresh::text = c.cur_snap::text;
        win := @extschema@.outbox_stream_window(c.cur_snap, fresh);
        EXIT WHEN win.hi IS NULL;
        c.prev_snap := c.cur_snap;
        c.cur_snap := fresh;
        c.pos_id := 0;
        c.win_lo := win.lo;
        c.win_hi := win.hi;
        -- Read after the snapshot: every event it sees existed by now.
        c.id_hwm := coalesce((SELECT max(e.id) FROM @extschema@.outbox_stream e), 0);
    END LOOP;
    IF cardinality(array_remove(hashes, NULL)) > 0 THEN
        SELECT d.ids, d.hashes INTO ids, hashes
          FROM @extschema@.outbox_stream_divert(ids, hashes, stamp, c.batch_floor) d;
    END IF;
    IF cardinality(ids) > 0 THEN
        INSERT INTO @extschema@.outbox_stream_batch (claim_token, claim_owner, claimed_at, pending, keys)
        VALUES (token, owner, stamp, ARRAY(SELECT t FROM unnest(ids) t ORDER BY t),
                ARRAY(SELECT DISTINCT t FROM unnest(hashes) t WHERE t IS NOT NULL));
        -- The floor moves up to the oldest unsettled batch, read by primary key from the old
        -- floor. least(): a claim draws its token before it waits for the stream's lock, so a
        -- later token may have written its batch first.
        c.batch_floor := least(token, (SELECT min(b.claim_token) FROM @extschema@.outbox_stream_batch b
                                        WHERE b.claim_token >= c.batch_floor));
    END IF;
    -- The new position and floor commit with the batch, as a new version: under an old snapshot
    -- the dead versions stay in the index, so the old one goes by its key, not a range.
    IF c::text <> was THEN
        c.version := c.version + 1;
        INSERT INTO @extschema@.outbox_stream_cursor SELECT c.*;
        DELETE FROM @extschema@.outbox_stream_cursor v WHERE v.version = c.version - 1;
    END IF;
    RETURN ids;
END
$$;

-- Settles the ids of a batch its owner still holds (ack, nack, release): returns those it held,
-- in id order, and takes them out of the batch (deleting it once nothing is left). A batch that
-- reclaim took back, or another owner's, settles nothing: a late call is a no-op.
CREATE FUNCTION @extschema@.outbox_stream_settle(owner text, claim_token bigint, ids bigint[])
RETURNS bigint[]
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_variable
DECLARE
    pending bigint[];
    keys bigint[];
    waiters boolean;
    held bigint[];
BEGIN
    -- The usual case, the whole claim settled at once: one statement, no row lock of its own (a
    -- lock is a WAL record). A batch keeps its pending ids in id order.
    DELETE FROM @extschema@.outbox_stream_batch b
     WHERE b.claim_token = claim_token AND b.claim_owner = owner AND b.pending <@ ids
    RETURNING b.pending, b.keys, b.waiters INTO held, keys, waiters;
    IF NOT FOUND THEN
        SELECT b.pending, b.keys, b.waiters INTO pending, keys, waiters FROM @extschema@.outbox_stream_batch b
         WHERE b.claim_token = claim_token AND b.claim_owner = owner
           FOR UPDATE;
        IF pending IS NULL OR NOT pending && ids THEN
            RETURN '{}';
        END IF;
        held := ARRAY(SELECT p FROM unnest(pending) p WHERE p = ANY (ids) ORDER BY p);
        IF cardinality(held) = cardinality(pending) THEN
            -- Another settle of this claim took the rest meanwhile.
            DELETE FROM @extschema@.outbox_stream_batch b WHERE b.claim_token = claim_token;
        ELSE
            UPDATE @extschema@.outbox_stream_batch b
               -- IS NOT TRUE: a NULL among the ids must not drop the others from the batch.
               SET pending = ARRAY(SELECT p FROM unnest(pending) p WHERE (p = ANY (ids)) IS NOT TRUE ORDER BY p),
                   -- Events settled here may continue as scheduled rows (nack, release), whose key
                   -- waits for the rest of this batch.
                   waiters = b.waiters OR b.keys <> '{}'
             WHERE b.claim_token = claim_token;
        END IF;
    END IF;
    -- Held keys wait for this batch: each settle of part of it makes them due again. A key row
    -- locked now is being looked at by a claim or woken by an ack: never wait for it.
    IF waiters THEN
        UPDATE @extschema@.outbox_key k SET state = 'waiting', due_at = clock_timestamp()
          FROM (SELECT d.ctid AS row_id FROM @extschema@.outbox_key d
                 WHERE d.state = 'held' AND @extschema@.outbox_key_hash(d.topic, d.event_key) = ANY (keys)
                 FOR UPDATE SKIP LOCKED) w
         WHERE k.ctid = w.row_id;
    END IF;
    RETURN held;
END
$$;
