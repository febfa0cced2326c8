-- The claim: the wake-up's look at the queue, the scheduled part, and outbox_claim itself.

-- Whether a claim would find something now (outbox_wait's look): each probe stops at its first
-- index entry, whatever the backlog (min() against the clock cannot bound an index scan).
-- PL/pgSQL: planned once per session; a SQL function with SET clauses is planned at every look.
CREATE FUNCTION @extschema@.outbox_work_due() RETURNS boolean
LANGUAGE plpgsql VOLATILE
-- Every look is an index probe; bounds known only at run time must not lead to a scan.
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
BEGIN
    RETURN (
        -- The stream: the rest of the cursor's window, or a committed event of a later one (a plain
        -- read sees only committed rows): after xmax(cur_snap), or of a transaction it saw running.
        SELECT EXISTS (SELECT 1 FROM @extschema@.outbox_cursor() c
                        WHERE c.pos_id < c.win_hi
                           OR (SELECT e.id FROM @extschema@.outbox_stream e
                                WHERE e.txid >= pg_snapshot_xmax(c.cur_snap)
                                ORDER BY e.txid, e.id
                                LIMIT 1) IS NOT NULL
                           -- A scalar probe per txid: a join could be planned as a scan of the stream.
                           OR EXISTS (SELECT 1 FROM pg_snapshot_xip(c.cur_snap) x
                                       WHERE (SELECT e.id FROM @extschema@.outbox_stream e
                                               WHERE e.txid = x LIMIT 1) IS NOT NULL))
            -- (No such row: min is NULL, and the look must say false, not NULL.)
            OR coalesce((SELECT min(e.next_retry_time) FROM @extschema@.outbox_scheduled e
                          WHERE e.status = 'WAIT' AND NOT e.ordered) <= clock_timestamp(), false)
            OR coalesce((SELECT min(k.due_at) FROM @extschema@.outbox_key k WHERE k.state <> 'idle')
                        <= clock_timestamp(), false)
            OR EXISTS (SELECT 1 FROM @extschema@.outbox_key k
                        WHERE k.state = 'idle'
                          AND EXISTS (SELECT 1 FROM @extschema@.outbox_scheduled e
                                       WHERE e.topic = k.topic AND e.event_key = k.event_key
                                         AND e.ordered AND e.status = 'WAIT')));
END
$$;

-- Blocks until a claim may find something (true) or the timeout passes (false), in one statement
-- (docs/reference.md, "Wake-up"): woken at an enqueuing commit when the library is preloaded, else
-- polling every outbox.wait_poll_interval.
CREATE FUNCTION @extschema@.outbox_wait(timeout interval DEFAULT '1 second')
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF timeout IS NULL OR timeout < interval '0' OR timeout > interval '1 hour' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_wait: timeout must be between 0 and 1 hour',
            DETAIL = format('timeout = %s', coalesce(timeout::text, 'NULL'));
    END IF;
    -- Under REPEATABLE READ the looks would share one snapshot and never see a new event.
    PERFORM @extschema@.outbox_check_isolation('outbox_wait');
    RETURN @extschema@.outbox_wait_for((extract(epoch FROM timeout) * 1000)::bigint,
                                       '@extschema@.outbox_work_due()'::regprocedure);
END
$$;

-- The scheduled part of a claim: each due key's run (its WAIT, due events from its head, in id order)
-- and the oldest due unordered rows, up to max_events. Never waits for a lock (SKIP LOCKED); each
-- visited key row gets its next state, and idle ones are deleted.
CREATE FUNCTION @extschema@.outbox_claim_scheduled(owner text, token bigint, stamp timestamptz, max_events int)
RETURNS bigint[]
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_variable
DECLARE
    lease interval := make_interval(secs => (SELECT c.lease_ms FROM @extschema@.outbox_config() c) / 1000.0);
    -- missing_ok: the SQL-only build has no registered setting (its outbox_config() checks the value).
    skip_dead boolean := lower(coalesce(current_setting('outbox.head_of_line', true), '')) = 'skip';
    busy bigint[];
    claimed_ids bigint[];
    idle_topics text[];
    idle_keys text[];
BEGIN
    -- Keys of unsettled stream batches (this claim's own included): their scheduled events wait.
    busy := ARRAY(SELECT DISTINCT k FROM @extschema@.outbox_stream_batch b, unnest(b.keys) k
                   WHERE b.claim_token >= (SELECT c.batch_floor FROM @extschema@.outbox_cursor() c));
    -- The due keys, oldest due first, each with its run; a key row is locked only when reached,
    -- so a claim visits as few keys as fill it, and never more than max_events rows per key.
    WITH visit AS MATERIALIZED (
        SELECT k.ctid AS row_id, k.topic, k.event_key, k.due_at AS key_due, k.busy, p.*
          FROM (SELECT d.ctid, d.topic, d.event_key, d.due_at,
                       @extschema@.outbox_key_hash(d.topic, d.event_key) = ANY (busy) AS busy
                  FROM @extschema@.outbox_key d
                 WHERE d.due_at <= stamp
                 ORDER BY d.due_at
                 LIMIT least(max_events, 1000)
                 FOR UPDATE SKIP LOCKED) k
          LEFT JOIN LATERAL @extschema@.outbox_key_run(k.topic, k.event_key, k.busy, skip_dead, stamp,
                                                       max_events) p ON true
         LIMIT max_events
    ), unordered AS MATERIALIZED (
        SELECT c.id, c.next_retry_time
          FROM @extschema@.outbox_scheduled c
         WHERE c.status = 'WAIT' AND NOT c.ordered AND c.next_retry_time <= stamp
         ORDER BY c.next_retry_time, c.id
         LIMIT max_events
         FOR UPDATE SKIP LOCKED
    ), chosen AS MATERIALIZED (
        -- Cut by due time with a key's run ranked as one block, so a cut keeps a prefix.
        SELECT x.id FROM (
            SELECT v.id, v.key_due AS due, v.row_id AS grp, v.pos FROM visit v WHERE v.runnable
            UNION ALL
            SELECT u.id, u.next_retry_time, NULL::tid, 1 FROM unordered u
        ) x
        ORDER BY x.due, x.grp, x.pos
        LIMIT max_events
    ), claimed AS (
        -- The one statement that hands out scheduled rows.
        UPDATE @extschema@.outbox_scheduled e
           SET status = 'SENDING', claim_owner = owner, claim_token = token,
               claimed_at = stamp, updated_at = stamp
         WHERE e.id = ANY (ARRAY(SELECT chosen.id FROM chosen)) AND e.status = 'WAIT'
        RETURNING e.id
    ), heads AS (
        SELECT h.row_id, n.state, n.due_at
          FROM (SELECT v.row_id, min(v.key_due) AS key_due, bool_or(c.id IS NOT NULL) AS holding,
                       bool_or(v.busy) AS busy,
                       min(v.status) FILTER (WHERE v.pos = 1) AS status,
                       min(v.next_retry_time) FILTER (WHERE v.pos = 1) AS next_retry_time,
                       min(v.claimed_at) FILTER (WHERE v.pos = 1) AS claimed_at
                  FROM visit v LEFT JOIN chosen c ON c.id = v.id
                 GROUP BY v.row_id) h
         CROSS JOIN LATERAL @extschema@.outbox_key_next(h.holding, h.busy, h.status, h.next_retry_time,
                                                        h.claimed_at, h.key_due, stamp, lease) n
    ), looked AS (
        -- The key rows by their tuple ids: locked above, so they cannot have moved.
        UPDATE @extschema@.outbox_key k SET state = h.state, due_at = h.due_at
          FROM heads h
         WHERE k.ctid = ANY (ARRAY(SELECT v.row_id FROM visit v)) AND k.ctid = h.row_id
           AND (k.state, k.due_at) IS DISTINCT FROM (h.state, h.due_at)
    )
    SELECT (SELECT coalesce(array_agg(c.id), '{}') FROM claimed c),
           array_agg(v.topic) FILTER (WHERE v.id IS NULL), array_agg(v.event_key) FILTER (WHERE v.id IS NULL)
      INTO claimed_ids, idle_topics, idle_keys
      FROM visit v;
    PERFORM @extschema@.outbox_keys_drop_idle(idle_topics, idle_keys, skip_dead);
    RETURN claimed_ids;
END
$$;

-- outbox_claim's arguments and transaction: READ COMMITTED, nothing written yet, a valid owner and
-- max_events within outbox.max_claim. Raises 25001 or 22023.
CREATE FUNCTION @extschema@.outbox_check_claim(owner text, max_events int) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    PERFORM @extschema@.outbox_check_isolation('outbox_claim');
    -- A transaction that wrote may hold events of its own, which a claim would hand out
    -- uncommitted. Checked before the token's nextval, which may assign a transaction id itself.
    IF pg_current_xact_id_if_assigned() IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'active_sql_transaction',
            MESSAGE = 'outbox_claim: the transaction has already written; a claim must come first in its own transaction',
            HINT = 'Claim in a transaction of its own and commit right after (one claim per transaction).';
    END IF;
    PERFORM @extschema@.outbox_check_owner('outbox_claim', owner);
    PERFORM @extschema@.outbox_check_count('outbox_claim', 'max_events', max_events,
                                           (SELECT c.max_claim FROM @extschema@.outbox_config() c),
                                           'outbox.max_claim');
END
$$;

CREATE FUNCTION @extschema@.outbox_claim(owner text, max_events int DEFAULT 20)
RETURNS SETOF @extschema@.outbox_event
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Its statements and those of the functions it calls are planned once per session: with custom
-- plans, re-planned at every call, a small claim spent more time planning than running.
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    token bigint;
    -- Wall clock, not transaction start: a claim inside a long transaction must not stamp an old lease.
    stamp timestamptz := clock_timestamp();
    due_scheduled int;
    scheduled_ids bigint[] := '{}';
    stream_ids bigint[] := '{}';
    lo_id bigint;
    hi_id bigint;
BEGIN
    PERFORM @extschema@.outbox_check_claim(owner, max_events);
    token := nextval('@extschema@.outbox_claim_token_seq');
    -- A claim lost in a crash only hands its events out again, as its lease would: no need to
    -- wait for its WAL flush. The durable ack after it flushes it too (docs/reference.md).
    PERFORM set_config('synchronous_commit', 'off', true);
    -- The stream first, while the claim holds no row lock: its waits (the stream's lock, a key
    -- row being inserted) then never close a cycle (docs/design.md, "Lock order"). Due scheduled
    -- work keeps up to half of the batch, so retries and held keys never starve behind a backlog.
    due_scheduled := (SELECT count(*) FROM (SELECT 1 FROM @extschema@.outbox_scheduled e
                                            WHERE e.status = 'WAIT' AND NOT e.ordered AND e.next_retry_time <= stamp
                                            LIMIT max_events) u)
                 + (SELECT count(*) FROM (SELECT 1 FROM @extschema@.outbox_key k
                                            WHERE k.due_at <= stamp LIMIT max_events) k);
    stream_ids := @extschema@.outbox_stream_take(owner, token, stamp,
                                                 max_events - least(due_scheduled, (max_events + 1) / 2));
    -- The scheduled part only when it has work: scheduled rows due, or key rows due (idle ones
    -- included, to be deleted) before the stream's part or made due by it (diverted events).
    IF cardinality(stream_ids) < max_events
       AND (due_scheduled > 0 OR EXISTS (SELECT 1 FROM @extschema@.outbox_key k WHERE k.due_at <= stamp)) THEN
        scheduled_ids := @extschema@.outbox_claim_scheduled(owner, token, stamp, max_events - cardinality(stream_ids));
    END IF;

    IF cardinality(scheduled_ids) = 0 AND cardinality(stream_ids) = 0 THEN
        RETURN;
    END IF;
    -- The stream rows' ids are mostly consecutive: read them as one primary-key range when the
    -- range holds at most twice as many ids as the batch (id = ANY alone descends the index once
    -- per id, two buffers each), else by id.
    IF cardinality(stream_ids) > 0 THEN
        SELECT min(i), max(i) INTO lo_id, hi_id FROM unnest(stream_ids) i;
        IF hi_id - lo_id >= 2 * cardinality(stream_ids) THEN
            lo_id := NULL;
        END IF;
    END IF;
    -- A claim whose client is gone would hold its events for a dead owner until the lease ends:
    -- PostgreSQL runs a statement to its end after its client died (a relay SIGKILLed with this
    -- claim in flight), and commits it. Roll it back instead; nobody is there to see the error.
    IF (cardinality(scheduled_ids) > 0 OR cardinality(stream_ids) > 0)
       AND NOT @extschema@.outbox_client_connected() THEN
        RAISE EXCEPTION USING ERRCODE = 'connection_failure',
            MESSAGE = 'outbox_claim: the client disconnected; the claim is rolled back';
    END IF;
    -- Rows in publish (= id, within a key commit) order: UPDATE ... RETURNING has none.
    RETURN QUERY
    SELECT e.* FROM (
        SELECT t.id, t.topic, t.event_key, t.event_type, t.payload, t.headers, t.status, t.retry_count,
               t.next_retry_time, t.claim_owner, t.claim_token, t.claimed_at, t.last_error, t.created_at,
               t.updated_at, t.event_id, t.ordered, t.skipped_at
          FROM @extschema@.outbox_scheduled t WHERE t.id = ANY (scheduled_ids)
        UNION ALL
        SELECT s.id, s.topic, s.event_key, s.event_type, s.payload, s.headers,
               'SENDING'::@extschema@.outbox_status, 0, s.created_at, owner, token, stamp,
               NULL::text, s.created_at, stamp, s.event_id, s.key_hash IS NOT NULL, NULL::timestamptz
          FROM ((SELECT r.* FROM (SELECT r.* FROM @extschema@.outbox_stream r
                                   WHERE r.id BETWEEN lo_id AND hi_id
                                   OFFSET 0) r -- a fence: the id list filters the range, it does not drive the scan
                  JOIN unnest(stream_ids) u(id) ON u.id = r.id -- hashed, not a search of the list per row
                 WHERE lo_id IS NOT NULL)
                UNION ALL
                (SELECT r.* FROM @extschema@.outbox_stream r WHERE lo_id IS NULL AND r.id = ANY (stream_ids))) s
    ) e
    ORDER BY e.id;
END
$$;
