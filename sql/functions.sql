-- SQL API of the outbox (docs/reference.md). Every function is SECURITY DEFINER with
-- search_path pinned to pg_catalog, pg_temp and every outbox object schema-qualified: callers need
-- only EXECUTE on it, and neither their search_path nor objects planted in the extension's schema
-- (by a role that may CREATE there) can redirect a call, a cast or an operator. Every state change is ONE guarded UPDATE/DELETE: the
-- WHERE clause re-checks state, owner and fencing token, so a late or racing call is a no-op.

-- Argument checks shared by the relay-side calls. Raises 22023 naming the function and argument.
CREATE FUNCTION @extschema@.outbox_check_owner(fn text, owner text) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF owner IS NULL OR owner = '' OR length(owner) > 200 OR owner ~ '[[:cntrl:]]' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: owner must be 1 to 200 characters without control characters', fn),
            DETAIL = format('owner = %L', left(owner, 60));
    END IF;
END
$$;

CREATE FUNCTION @extschema@.outbox_check_ids(fn text, ids bigint[]) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF ids IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: ids must be an array of event ids, not NULL', fn);
    END IF;
END
$$;

-- Calls that lock event rows need READ COMMITTED: under REPEATABLE READ or SERIALIZABLE a row
-- that another relay changed after the snapshot fails the whole call with 40001. Refuse up front
-- with one clear error instead of failing now and then under load.
CREATE FUNCTION @extschema@.outbox_check_isolation(fn text) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    level text := current_setting('transaction_isolation');
BEGIN
    IF level <> 'read committed' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_transaction_state',
            MESSAGE = format('%s: must run at READ COMMITTED isolation, not %s', fn, upper(level)),
            HINT = 'Call it in its own transaction, or SET TRANSACTION ISOLATION LEVEL READ COMMITTED first.';
    END IF;
END
$$;

-- The arguments that name a held claim (ack, nack, renew): owner, token and ids.
CREATE FUNCTION @extschema@.outbox_check_claim_args(fn text, owner text, claim_token bigint, ids bigint[])
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM @extschema@.outbox_check_isolation(fn);
    PERFORM @extschema@.outbox_check_owner(fn, owner);
    IF claim_token IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: claim_token must be the token returned by outbox_claim, not NULL', fn);
    END IF;
    PERFORM @extschema@.outbox_check_ids(fn, ids);
END
$$;

-- A key's identity in the stream (outbox_stream.key_hash, outbox_stream_batch.keys): 64 bits, so
-- two keys share one about never, and when they do a claim only holds one back while the other
-- is busy. No SET clause, so the planner inlines it (an enqueue hot path); every function and
-- operator is named with its schema instead, so no search_path can redirect it.
CREATE FUNCTION @extschema@.outbox_key_hash(topic text, event_key text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT pg_catalog.hashtextextended(topic OPERATOR(pg_catalog.||) '/' OPERATOR(pg_catalog.||) event_key, 0)
$$;

CREATE FUNCTION @extschema@.outbox_enqueue(
    topic text,
    payload jsonb,
    key text DEFAULT NULL,
    event_type text DEFAULT NULL,
    headers jsonb DEFAULT '{}',
    deliver_at timestamptz DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    header record;
    payload_bytes int;
    message_bytes bigint;
    max_bytes int;
    new_id bigint;
    ordered boolean;
BEGIN
    -- In Rust, one call: the topic's format and the operator's allow-list (outbox.allowed_topics),
    -- the note that wakes outbox_wait at commit, and whether the key keeps its order.
    ordered := @extschema@.outbox_enqueue_begin(topic, key);
    IF payload IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'null_value_not_allowed',
            MESSAGE = 'outbox_enqueue: payload must not be NULL (use ''null''::jsonb for a JSON null)';
    END IF;
    headers := coalesce(headers, '{}'::jsonb);
    IF jsonb_typeof(headers) <> 'object' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_enqueue: headers must be a JSON object whose values are strings',
            DETAIL = format('headers is a JSON %s', jsonb_typeof(headers));
    END IF;
    IF headers <> '{}'::jsonb THEN
        FOR header IN SELECT h.key, jsonb_typeof(h.value) AS kind FROM jsonb_each(headers) h LOOP
            IF header.kind <> 'string' THEN
                RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
                    MESSAGE = 'outbox_enqueue: headers must be a JSON object whose values are strings',
                    DETAIL = format('header %L is a JSON %s', header.key, header.kind);
            END IF;
            IF header.key IN ('event_id', 'event_type', 'event_key', 'outbox_id') THEN
                RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
                    MESSAGE = format('outbox_enqueue: header %L is set by the relay and cannot be given in headers', header.key);
            END IF;
        END LOOP;
    END IF;
    -- 'infinity' would be stored and never become due.
    IF NOT isfinite(deliver_at) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_enqueue: deliver_at must be a finite timestamp (or NULL for now)',
            DETAIL = format('deliver_at = %s', deliver_at);
    END IF;
    -- The limit guards the whole message the relay will send: payload, key and headers.
    payload_bytes := octet_length(payload::text);
    message_bytes := payload_bytes::bigint + coalesce(octet_length(key), 0)
                     + CASE WHEN headers = '{}'::jsonb THEN 0 ELSE octet_length(headers::text) END;
    max_bytes := @extschema@.outbox_max_payload_bytes();
    IF message_bytes > max_bytes THEN
        RAISE EXCEPTION USING ERRCODE = 'program_limit_exceeded',
            MESSAGE = format('outbox_enqueue: message is %s bytes (payload %s, key %s, headers %s), outbox.max_payload_bytes allows at most %s',
                             message_bytes, payload_bytes, coalesce(octet_length(key), 0),
                             message_bytes - payload_bytes - coalesce(octet_length(key), 0), max_bytes);
    END IF;

    IF deliver_at > now() THEN
        -- Due later: a tracked row, claimed by its next_retry_time. It takes no part in its key's
        -- order (a reminder due tomorrow must not hold the key's other events until then).
        INSERT INTO @extschema@.outbox_tracked
            (topic, event_key, event_type, payload, headers, status, next_retry_time, ordered)
        VALUES
            (topic, key, event_type, payload, headers, 'WAIT', deliver_at, false)
        RETURNING id INTO new_id;
    ELSE
        -- One append-only row, never written again (outbox_stream); an ordered event carries its
        -- key's hash, by which the claim keeps the key's order.
        INSERT INTO @extschema@.outbox_stream (topic, event_key, key_hash, event_type, payload, headers)
        VALUES (topic, key, CASE WHEN ordered THEN @extschema@.outbox_key_hash(topic, key) END,
                event_type, payload, headers)
        RETURNING id INTO new_id;
    END IF;

    -- Off by default: relays wait with outbox_wait. NOTIFY is for a listener of the application's
    -- own, and makes notifying transactions commit one at a time (docs/reference.md, "Wake-up").
    IF @extschema@.outbox_notify_enabled() THEN
        PERFORM pg_notify('outbox', '');
    END IF;
    RETURN new_id;
END
$$;

-- Many events of one topic in one call, all or nothing, with outbox_enqueue's checks and errors
-- (each error names the array position, counted from 1): the arrays are read in step, keys,
-- event_types and headers being NULL or as long as payloads. Returns the ids in array order;
-- within a key, array order is publish order.
CREATE FUNCTION @extschema@.outbox_enqueue_many(
    topic text,
    payloads jsonb[],
    keys text[] DEFAULT NULL,
    event_types text[] DEFAULT NULL,
    headers jsonb[] DEFAULT NULL,
    deliver_at timestamptz DEFAULT NULL
) RETURNS SETOF bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    fn constant text := 'outbox_enqueue_many';
    n int := coalesce(cardinality(payloads), 0);
    ordered_topic boolean;
    due_later boolean := coalesce(deliver_at > now(), false);
    bad record;
    max_bytes int;
BEGIN
    -- The topic's checks and the wake-up note, once for the whole batch.
    PERFORM @extschema@.outbox_enqueue_begin(topic, NULL);
    ordered_topic := @extschema@.outbox_topic_ordered(topic);
    IF payloads IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'null_value_not_allowed',
            MESSAGE = format('%s: payloads must be an array of JSON values, not NULL', fn);
    END IF;
    IF array_ndims(payloads) > 1 OR array_ndims(keys) > 1 OR array_ndims(event_types) > 1
       OR array_ndims(headers) > 1 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: the arrays must be one-dimensional', fn);
    END IF;
    SELECT a.name, a.len INTO bad
      FROM (VALUES ('keys', cardinality(keys)), ('event_types', cardinality(event_types)),
                   ('headers', cardinality(headers))) a(name, len)
     WHERE a.len IS NOT NULL AND a.len <> n
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: %s has %s elements, payloads %s (give one per payload, or NULL)',
                             fn, bad.name, bad.len, n);
    END IF;
    IF NOT isfinite(deliver_at) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: deliver_at must be a finite timestamp (or NULL for now)', fn),
            DETAIL = format('deliver_at = %s', deliver_at);
    END IF;

    -- Every element is checked before anything is written; the first bad one is reported.
    SELECT u.pos INTO bad FROM unnest(payloads) WITH ORDINALITY u(p, pos) WHERE u.p IS NULL LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'null_value_not_allowed',
            MESSAGE = format('%s: payloads[%s] is NULL (use ''null''::jsonb for a JSON null)', fn, bad.pos);
    END IF;
    SELECT u.pos, jsonb_typeof(u.h) AS kind INTO bad
      FROM unnest(headers) WITH ORDINALITY u(h, pos)
     WHERE u.h IS NOT NULL AND jsonb_typeof(u.h) <> 'object'
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: headers[%s] must be a JSON object whose values are strings', fn, bad.pos),
            DETAIL = format('headers[%s] is a JSON %s', bad.pos, bad.kind);
    END IF;
    SELECT u.pos, e.key, jsonb_typeof(e.value) AS kind INTO bad
      FROM unnest(headers) WITH ORDINALITY u(h, pos)
      CROSS JOIN LATERAL jsonb_each(u.h) e
     WHERE u.h IS NOT NULL AND u.h <> '{}'::jsonb
       AND (jsonb_typeof(e.value) <> 'string' OR e.key IN ('event_id', 'event_type', 'event_key', 'outbox_id'))
     ORDER BY u.pos
     LIMIT 1;
    IF FOUND AND bad.kind <> 'string' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: headers[%s] must be a JSON object whose values are strings', fn, bad.pos),
            DETAIL = format('header %L is a JSON %s', bad.key, bad.kind);
    ELSIF FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: headers[%s]: header %L is set by the relay and cannot be given in headers', fn, bad.pos, bad.key);
    END IF;
    max_bytes := @extschema@.outbox_max_payload_bytes();
    SELECT m.pos, m.payload_bytes, m.key_bytes, m.header_bytes INTO bad
      FROM (SELECT u.pos, octet_length(u.p::text) AS payload_bytes,
                   coalesce(octet_length(u.k), 0) AS key_bytes,
                   CASE WHEN coalesce(u.h, '{}'::jsonb) = '{}'::jsonb THEN 0 ELSE octet_length(u.h::text) END AS header_bytes
              FROM unnest(payloads, keys, headers) WITH ORDINALITY u(p, k, h, pos)) m
     WHERE m.payload_bytes::bigint + m.key_bytes + m.header_bytes > max_bytes
     ORDER BY m.pos
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'program_limit_exceeded',
            MESSAGE = format('%s: payloads[%s]: message is %s bytes (payload %s, key %s, headers %s), outbox.max_payload_bytes allows at most %s',
                             fn, bad.pos, bad.payload_bytes::bigint + bad.key_bytes + bad.header_bytes,
                             bad.payload_bytes, bad.key_bytes, bad.header_bytes, max_bytes);
    END IF;

    -- Ids are drawn in array order; events due later go to outbox_tracked (unordered, as in
    -- outbox_enqueue), the rest to outbox_stream.
    IF due_later THEN
        RETURN QUERY
        INSERT INTO @extschema@.outbox_tracked
            (topic, event_key, event_type, payload, headers, status, next_retry_time, ordered)
        SELECT topic, u.k, u.t, u.p, coalesce(u.h, '{}'::jsonb), 'WAIT', deliver_at, false
          FROM unnest(payloads, keys, event_types, headers) WITH ORDINALITY u(p, k, t, h, pos)
         ORDER BY u.pos
        RETURNING outbox_tracked.id;
    ELSE
        RETURN QUERY
        INSERT INTO @extschema@.outbox_stream (topic, event_key, key_hash, event_type, payload, headers)
        SELECT topic, u.k, CASE WHEN ordered_topic AND u.k IS NOT NULL THEN @extschema@.outbox_key_hash(topic, u.k) END,
               u.t, u.p, coalesce(u.h, '{}'::jsonb)
          FROM unnest(payloads, keys, event_types, headers) WITH ORDINALITY u(p, k, t, h, pos)
         ORDER BY u.pos
        RETURNING outbox_stream.id;
    END IF;

    IF @extschema@.outbox_notify_enabled() AND n > 0 THEN
        PERFORM pg_notify('outbox', '');
    END IF;
END
$$;

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
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    caller_lock_timeout text := current_setting('lock_timeout');
BEGIN
    IF pg_try_advisory_xact_lock(@extschema@.outbox_stream_lock_id()) THEN
        RETURN true;
    END IF;
    PERFORM set_config('lock_timeout', '1s', true);
    BEGIN
        PERFORM pg_advisory_xact_lock(@extschema@.outbox_stream_lock_id());
    EXCEPTION WHEN lock_not_available THEN
        PERFORM set_config('lock_timeout', caller_lock_timeout, true);
        RETURN false;
    END;
    PERFORM set_config('lock_timeout', caller_lock_timeout, true);
    RETURN true;
END
$$;

-- A cursor restored into another cluster (see outbox_stream_take), made good before a fresh
-- cursor starts: every event it had not handed out (not passed by its position, or newer than its
-- window: an id above hwm) becomes a tracked row due now, every event a claim held becomes a
-- tracked row held by that claim (its relay may still ack it; reclaim frees it after the lease),
-- and stream rows whose txid this cluster has not reached yet are deleted, so that they are never
-- handed out again once it does. Loud: a restore into another cluster re-delivers.
CREATE FUNCTION @extschema@.outbox_stream_rebase(prev_snap pg_snapshot, cur_snap pg_snapshot,
                                                 pos_id bigint, hwm bigint)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    stamp timestamptz := clock_timestamp();
    owed bigint;
    held bigint;
    moved_ids bigint[];
BEGIN
    WITH claimed AS (
        SELECT p.id, b.claim_owner, b.claim_token, b.claimed_at
          FROM @extschema@.outbox_stream_batch b CROSS JOIN LATERAL unnest(b.pending) AS p(id)
    ), moved AS (
        INSERT INTO @extschema@.outbox_tracked
            (id, topic, event_key, event_type, payload, headers, status, retry_count,
             next_retry_time, claim_owner, claim_token, claimed_at, created_at, updated_at,
             event_id, ordered)
        SELECT s.id, s.topic, s.event_key, s.event_type, s.payload, s.headers,
               CASE WHEN c.id IS NULL THEN 'WAIT' ELSE 'SENDING' END::@extschema@.outbox_status, 0,
               stamp, c.claim_owner, c.claim_token, c.claimed_at, s.created_at, stamp, s.event_id,
               s.key_hash IS NOT NULL
          FROM @extschema@.outbox_stream s
          LEFT JOIN claimed c ON c.id = s.id
         WHERE (c.id IS NOT NULL OR s.id > hwm
                OR NOT @extschema@.outbox_stream_passed(s.txid, s.id, prev_snap, cur_snap, pos_id))
           AND NOT EXISTS (SELECT 1 FROM @extschema@.outbox_tracked t WHERE t.id = s.id)
         ORDER BY s.id
        RETURNING outbox_tracked.id, outbox_tracked.status
    )
    SELECT count(*) FILTER (WHERE m.status = 'WAIT'), count(*) FILTER (WHERE m.status = 'SENDING'),
           coalesce(array_agg(m.id), '{}')
      INTO owed, held, moved_ids FROM moved m;
    PERFORM @extschema@.outbox_stream_key_rows(moved_ids, stamp);
    DELETE FROM @extschema@.outbox_stream_batch;
    DELETE FROM @extschema@.outbox_stream s
     WHERE s.txid >= pg_snapshot_xmax(pg_current_snapshot())
        OR EXISTS (SELECT 1 FROM @extschema@.outbox_tracked t WHERE t.id = s.id);
    RAISE WARNING USING
        MESSAGE = format('outbox: the stream''s cursor is ahead of this cluster''s transaction ids (a restore into another cluster?): %s events not yet handed out and %s held by a claim are now tracked rows, delivered again; a fresh cursor starts', owed, held);
END
$$;

-- The key rows of the ordered ones among stream events that become tracked rows (diverted from a
-- busy key, nacked, released, reclaimed), due at `due` or sooner: from here on their key's claims
-- go through outbox_key. In key order, the one order of every writer of several key rows.
CREATE FUNCTION @extschema@.outbox_stream_key_rows(ids bigint[], due timestamptz) RETURNS void
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO @extschema@.outbox_key AS k (topic, event_key, due_at)
    SELECT DISTINCT s.topic, s.event_key, due
      FROM @extschema@.outbox_stream s
     WHERE s.id = ANY (ids) AND s.key_hash IS NOT NULL
     ORDER BY 1, 2
    ON CONFLICT ON CONSTRAINT outbox_key_pkey DO UPDATE SET due_at = least(k.due_at, excluded.due_at)
$$;

-- The window between two snapshots: the events whose transaction cur_snap sees finished and
-- prev_snap does not. lo: the smallest id among those of transactions begun after prev_snap; hi:
-- the largest id of all. Transactions prev_snap saw running are read by equality on txid: a long
-- transaction costs a probe, not a range.
CREATE FUNCTION @extschema@.outbox_stream_window(prev_snap pg_snapshot, cur_snap pg_snapshot,
                                                 OUT lo bigint, OUT hi bigint)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT min(w.id) FILTER (WHERE w.newer), max(w.id)
      FROM (SELECT e.id, true AS newer FROM @extschema@.outbox_stream e
             WHERE e.txid >= pg_snapshot_xmax(prev_snap) AND e.txid < pg_snapshot_xmax(cur_snap)
               AND pg_visible_in_snapshot(e.txid, cur_snap)
            UNION ALL
            SELECT (SELECT max(e.id) FROM @extschema@.outbox_stream e WHERE e.txid = x), false
              FROM pg_snapshot_xip(prev_snap) x
             WHERE pg_visible_in_snapshot(x, cur_snap)) w
$$;

-- Up to `need` events of the window after the position pos_id, in id order: those of
-- transactions prev_snap saw running, by txid, and those of transactions begun after it, one
-- primary-key range from lo to hi (outbox_stream_window). No SET clause, so the planner inlines
-- it and the claim keeps its plan; every function and operator is named with its schema instead.
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

-- Events of busy keys become tracked rows due now, behind their key's head, with a key row for a
-- key that has none (in key order; only a holder of the stream's lock deletes key rows). The
-- batches holding such keys learn that keys wait for them (SKIP LOCKED), so that settling them
-- makes those keys due; a key row the claim looks at in a second anyway is made due now.
CREATE FUNCTION @extschema@.outbox_stream_divert(ids bigint[], busy bigint[], stamp timestamptz, floor bigint)
RETURNS void
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO @extschema@.outbox_tracked
        (id, topic, event_key, event_type, payload, headers, status, retry_count,
         next_retry_time, created_at, updated_at, event_id, ordered)
    SELECT s.id, s.topic, s.event_key, s.event_type, s.payload, s.headers, 'WAIT', 0,
           stamp, s.created_at, stamp, s.event_id, true
      FROM @extschema@.outbox_stream s
     WHERE s.id = ANY (ids) AND s.key_hash = ANY (busy)
     ORDER BY s.id;
    INSERT INTO @extschema@.outbox_key (topic, event_key, due_at)
    SELECT DISTINCT s.topic, s.event_key, stamp
      FROM @extschema@.outbox_stream s
     WHERE s.id = ANY (ids) AND s.key_hash = ANY (busy)
       AND NOT EXISTS (SELECT 1 FROM @extschema@.outbox_key d
                        WHERE d.topic = s.topic AND d.event_key = s.event_key)
     ORDER BY 1, 2
    ON CONFLICT DO NOTHING;
    UPDATE @extschema@.outbox_key k SET due_at = stamp
      FROM (SELECT d.ctid AS row_id FROM @extschema@.outbox_key d
             WHERE @extschema@.outbox_key_hash(d.topic, d.event_key) = ANY (busy)
               AND d.due_at > stamp AND d.due_at <= stamp + interval '1 second'
             FOR UPDATE SKIP LOCKED) w
     WHERE k.ctid = w.row_id;
    UPDATE @extschema@.outbox_stream_batch b SET waiters = true
     WHERE b.claim_token IN (SELECT o.claim_token FROM @extschema@.outbox_stream_batch o
                              WHERE o.claim_token >= floor AND o.keys && busy AND NOT o.waiters
                              FOR UPDATE SKIP LOCKED);
$$;

-- The stream's part of a claim: up to max_events fresh events, recorded as the batch of this
-- claim's token, their ids returned. PgQ's batch rule: the cursor hands out the events whose
-- transaction its newer snapshot (cur_snap) sees finished and its older one (prev_snap) does
-- not, in id order; once that window is used up, cur_snap becomes prev_snap and a fresh snapshot
-- cur_snap. An id is drawn before its transaction commits, so no order by id alone can avoid
-- passing an event that commits later; a snapshot can. Within a window, id order is commit order
-- for the events of producers that take turns (on a key's aggregate row): the later one drew
-- its id after the earlier one committed. An event of a busy key (in another unsettled batch,
-- or with a key row) goes behind that key's work instead (outbox_stream_divert).
CREATE FUNCTION @extschema@.outbox_stream_take(owner text, token bigint, stamp timestamptz, max_events int)
RETURNS bigint[]
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
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
    busy bigint[];
BEGIN
    IF NOT @extschema@.outbox_stream_lock() THEN
        RETURN '{}';
    END IF;
    -- A statement after the lock: its snapshot sees the last holder's position.
    SELECT * INTO c FROM @extschema@.outbox_stream_cursor v ORDER BY v.version DESC LIMIT 1;
    was := c::text;
    -- A cursor ahead of this database's transaction ids was restored into another cluster (the
    -- SQL-only build's pg_dump carries it): its snapshots say nothing about the txids here.
    IF pg_snapshot_xmax(c.cur_snap) > pg_snapshot_xmax(pg_current_snapshot()) THEN
        PERFORM @extschema@.outbox_stream_rebase(c.prev_snap, c.cur_snap, c.pos_id, c.id_hwm);
        c.prev_snap := @extschema@.outbox_snapshot_of_others();
        c.cur_snap := c.prev_snap;
        c.pos_id := 0;
        c.win_lo := NULL;
        c.win_hi := 0;
        c.id_hwm := coalesce((SELECT max(e.id) FROM @extschema@.outbox_stream e), 0);
        was := '';
    END IF;
    FOR w IN 1..2 LOOP
        SELECT array_agg(s.id ORDER BY s.id), array_agg(s.key_hash ORDER BY s.id)
          INTO part_ids, part_hashes
          FROM @extschema@.outbox_stream_walk(c.prev_snap, c.cur_snap, c.pos_id, c.win_lo, c.win_hi,
                                              max_events - cardinality(ids)) s;
        IF part_ids IS NOT NULL THEN
            ids := ids || part_ids;
            hashes := hashes || part_hashes;
            c.pos_id := part_ids[cardinality(part_ids)];
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
        -- Busy: in another unsettled batch (few rows), or with a key row (read only if any).
        busy := ARRAY(SELECT DISTINCT k FROM @extschema@.outbox_stream_batch b, unnest(b.keys) k
                       WHERE b.claim_token >= c.batch_floor AND k = ANY (hashes));
        IF EXISTS (SELECT 1 FROM @extschema@.outbox_key) THEN
            busy := busy || ARRAY(SELECT DISTINCT s.key_hash FROM @extschema@.outbox_stream s
                                    JOIN @extschema@.outbox_key k ON k.topic = s.topic AND k.event_key = s.event_key
                                   WHERE s.id = ANY (ids) AND s.key_hash IS NOT NULL);
        END IF;
        IF cardinality(busy) > 0 THEN
            PERFORM @extschema@.outbox_stream_divert(ids, busy, stamp, c.batch_floor);
            SELECT coalesce(array_agg(t.id ORDER BY t.id), '{}'), coalesce(array_agg(t.h ORDER BY t.id), '{}')
              INTO ids, hashes
              FROM unnest(ids, hashes) t(id, h)
             WHERE (t.h = ANY (busy)) IS NOT TRUE;
        END IF;
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
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    pending bigint[];
    keys bigint[];
    waiters boolean;
    held bigint[];
BEGIN
    SELECT b.pending, b.keys, b.waiters INTO pending, keys, waiters FROM @extschema@.outbox_stream_batch b
     WHERE b.claim_token = claim_token AND b.claim_owner = owner
       FOR UPDATE;
    IF pending IS NULL OR NOT pending && ids THEN
        RETURN '{}';
    END IF;
    held := ARRAY(SELECT p FROM unnest(pending) p WHERE p = ANY (ids) ORDER BY p);
    IF cardinality(held) = cardinality(pending) THEN
        -- The usual case, the whole claim settled at once: no new version of the row.
        DELETE FROM @extschema@.outbox_stream_batch b WHERE b.claim_token = claim_token;
    ELSE
        UPDATE @extschema@.outbox_stream_batch b
           -- IS NOT TRUE: a NULL among the ids must not drop the others from the batch.
           SET pending = ARRAY(SELECT p FROM unnest(pending) p WHERE (p = ANY (ids)) IS NOT TRUE ORDER BY p),
               -- Events settled here may continue as tracked rows (nack, release), whose key
               -- waits for the rest of this batch.
               waiters = b.waiters OR b.keys <> '{}'
         WHERE b.claim_token = claim_token;
    END IF;
    -- Tracked keys wait for this batch: each time part of it is settled they are due again
    -- (their claim looks whether the key is still busy). Rare: the key rows are few and read
    -- whole. A key row locked right now is being looked at by a claim (which looks again within
    -- a second while the key is held) or made due by an ack: never wait for it.
    IF waiters THEN
        UPDATE @extschema@.outbox_key k SET due_at = least(k.due_at, clock_timestamp())
          FROM (SELECT d.ctid AS row_id FROM @extschema@.outbox_key d
                 WHERE @extschema@.outbox_key_hash(d.topic, d.event_key) = ANY (keys)
                 FOR UPDATE SKIP LOCKED) w
         WHERE k.ctid = w.row_id;
    END IF;
    RETURN held;
END
$$;

-- Whether a claim would find something now: a due unordered event, or a due key (one that looked
-- idle counts only once an event of it waits, else a producer still in its transaction would keep
-- it "due" and waiters would spin). outbox_wait's look at the queue, so each probe is an index
-- probe that stops at its first entry, whatever the history or the backlog:
-- - the stream's is a scalar subquery in index order, not EXISTS: the planner drops an EXISTS'
--   ORDER BY and LIMIT, and, guessing that a third of the stream lies past the cursor, would scan
--   the table from its first page;
-- - the backoff and key probes read the earliest time from their indexes (min), then compare it
--   with the clock: clock_timestamp() cannot bound an index scan.
CREATE FUNCTION @extschema@.outbox_work_due() RETURNS boolean
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
-- Every look is an index probe; bounds known only at run time must not lead to a scan.
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
    -- The stream: the rest of the cursor's window, or a committed event of a later one (a plain
    -- read sees only committed rows): after xmax(cur_snap), or of a transaction it saw running.
    SELECT EXISTS (SELECT 1 FROM (SELECT v.* FROM @extschema@.outbox_stream_cursor v
                                   ORDER BY v.version DESC LIMIT 1) c
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
        OR coalesce((SELECT min(e.next_retry_time) FROM @extschema@.outbox_tracked e
                      WHERE e.status = 'WAIT' AND NOT e.ordered) <= clock_timestamp(), false)
        OR coalesce((SELECT min(k.due_at) FROM @extschema@.outbox_key k WHERE k.due_at > '-infinity')
                    <= clock_timestamp(), false)
        OR EXISTS (SELECT 1 FROM @extschema@.outbox_key k
                    WHERE k.due_at = '-infinity'
                      AND EXISTS (SELECT 1 FROM @extschema@.outbox_tracked e
                                   WHERE e.topic = k.topic AND e.event_key = k.event_key
                                     AND e.ordered AND e.status = 'WAIT'))
$$;

-- Blocks until a claim may find something (true) or the timeout passes (false): the relay's
-- wake-up, without LISTEN/NOTIFY (docs/reference.md, "Wake-up"). With shared_preload_libraries =
-- 'outbox', the commit of a transaction that enqueued wakes it at once; without, it looks at the
-- queue every outbox.wait_poll_interval. One statement: works through a transaction pooler.
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

-- The tracked part of a claim: up to max_events due events in row state, under the claim's token.
-- Each due key's run (the prefix of its unfinished events from its head, in id order, that are
-- WAIT and due, none while the key is busy in a stream batch) and the oldest due unordered rows.
-- It never waits for a lock: key rows and rows are taken SKIP LOCKED, so concurrent claimers
-- split them. Each visited key row gets its next state; keys found idle are deleted.
CREATE FUNCTION @extschema@.outbox_claim_tracked(owner text, token bigint, stamp timestamptz, max_events int)
RETURNS bigint[]
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
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
    -- Keys of unsettled stream batches (this claim's own included): their tracked events wait.
    busy := ARRAY(SELECT DISTINCT k FROM @extschema@.outbox_stream_batch b, unnest(b.keys) k
                   WHERE b.claim_token >= (SELECT v.batch_floor FROM @extschema@.outbox_stream_cursor v
                                            ORDER BY v.version DESC LIMIT 1));
    -- The due keys, oldest due first, each with its unfinished events from its head as far as
    -- they are runnable, and the head in any case; a key row is locked only when reached, so a
    -- claim visits as few keys as fill it, and never more than max_events rows per key.
    WITH visit AS MATERIALIZED (
        SELECT k.ctid AS row_id, k.topic, k.event_key, k.due_at AS key_due, k.busy, p.*
          FROM (SELECT d.ctid, d.topic, d.event_key, d.due_at,
                       @extschema@.outbox_key_hash(d.topic, d.event_key) = ANY (busy) AS busy
                  FROM @extschema@.outbox_key d
                 WHERE d.due_at <= stamp
                 ORDER BY d.due_at
                 LIMIT least(max_events, 1000)
                 FOR UPDATE SKIP LOCKED) k
          LEFT JOIN LATERAL (
              SELECT r.* FROM (
                  SELECT e.id, e.status, e.next_retry_time, e.claimed_at,
                         row_number() OVER (ORDER BY e.id) AS pos,
                         bool_and(e.status = 'WAIT' AND e.next_retry_time <= stamp AND NOT k.busy)
                             OVER (ORDER BY e.id) AS runnable
                    FROM @extschema@.outbox_tracked e
                   WHERE e.topic = k.topic AND e.event_key = k.event_key
                     AND e.ordered AND e.status <> 'SUCCESS'
                     AND NOT (e.status = 'FAIL' AND (skip_dead OR e.skipped_at IS NOT NULL))
                   ORDER BY e.id
                   LIMIT max_events) r
               WHERE r.runnable OR r.pos = 1
          ) p ON true
         LIMIT max_events
    ), unordered AS MATERIALIZED (
        SELECT c.id, c.next_retry_time
          FROM @extschema@.outbox_tracked c
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
        -- The one statement that hands out tracked rows.
        UPDATE @extschema@.outbox_tracked e
           SET status = 'SENDING', claim_owner = owner, claim_token = token,
               claimed_at = stamp, updated_at = stamp
         WHERE e.id = ANY (ARRAY(SELECT chosen.id FROM chosen)) AND e.status = 'WAIT'
        RETURNING e.id
    ), heads AS (
        SELECT h.*, @extschema@.outbox_key_next_due(h.holding, h.busy, h.status, h.next_retry_time,
                                                    h.claimed_at, h.key_due, stamp, lease) AS next_due
          FROM (SELECT v.row_id, min(v.key_due) AS key_due, bool_or(c.id IS NOT NULL) AS holding,
                       bool_or(v.busy) AS busy,
                       min(v.status) FILTER (WHERE v.pos = 1) AS status,
                       min(v.next_retry_time) FILTER (WHERE v.pos = 1) AS next_retry_time,
                       min(v.claimed_at) FILTER (WHERE v.pos = 1) AS claimed_at
                  FROM visit v LEFT JOIN chosen c ON c.id = v.id
                 GROUP BY v.row_id) h
    ), looked AS (
        -- The key rows by their tuple ids: locked above, so they cannot have moved.
        UPDATE @extschema@.outbox_key k SET due_at = h.next_due
          FROM heads h
         WHERE k.ctid = ANY (ARRAY(SELECT v.row_id FROM visit v)) AND k.ctid = h.row_id
           AND k.due_at <> h.next_due
    )
    SELECT (SELECT coalesce(array_agg(c.id), '{}') FROM claimed c),
           array_agg(v.topic) FILTER (WHERE v.id IS NULL), array_agg(v.event_key) FILTER (WHERE v.id IS NULL)
      INTO claimed_ids, idle_topics, idle_keys
      FROM visit v;
    -- Idle keys (locked above) are deleted, unless an event of theirs is unfinished, only by a
    -- claim that holds the stream's lock: no claim then diverts an event to a key row half deleted.
    IF idle_topics IS NOT NULL AND pg_try_advisory_xact_lock(@extschema@.outbox_stream_lock_id()) THEN
        DELETE FROM @extschema@.outbox_key k
         USING unnest(idle_topics, idle_keys) AS t(topic, event_key)
         WHERE k.topic = t.topic AND k.event_key = t.event_key AND k.due_at = '-infinity'
           AND NOT EXISTS (
               SELECT 1 FROM @extschema@.outbox_tracked e
                WHERE e.topic = k.topic AND e.event_key = k.event_key
                  AND e.ordered AND e.status <> 'SUCCESS'
                  AND NOT (e.status = 'FAIL' AND (skip_dead OR e.skipped_at IS NOT NULL)));
    END IF;
    RETURN claimed_ids;
END
$$;

-- When a visited key needs a look next: after its run (the lease, unless settled sooner), at its
-- head's backoff, never while a dead head blocks it ('infinity'), when the stream batch holding
-- it is settled, or it is idle ('-infinity': deleted by the claim).
CREATE FUNCTION @extschema@.outbox_key_next_due(holding boolean, busy boolean,
                                                head_status @extschema@.outbox_status,
                                                head_due timestamptz, head_claimed timestamptz,
                                                key_due timestamptz, stamp timestamptz, lease interval)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN holding THEN stamp + lease
                WHEN head_status IS NULL THEN '-infinity'::timestamptz
                WHEN head_status = 'WAIT' AND head_due <= stamp AND busy THEN stamp + interval '1 second'
                WHEN head_status = 'WAIT' AND head_due <= stamp THEN key_due
                WHEN head_status = 'WAIT' THEN head_due
                WHEN head_status = 'SENDING' THEN greatest(head_claimed + lease, stamp + interval '1 second')
                ELSE 'infinity'::timestamptz
           END
$$;

CREATE FUNCTION @extschema@.outbox_claim(owner text, max_events int DEFAULT 20)
RETURNS SETOF @extschema@.outbox_event
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cfg record;
    token bigint;
    -- Wall clock, not transaction start: a claim inside a long transaction must not stamp an old lease.
    stamp timestamptz := clock_timestamp();
    due_tracked int;
    tracked_ids bigint[] := '{}';
    stream_ids bigint[] := '{}';
    lo_id bigint;
    hi_id bigint;
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
    SELECT * INTO cfg FROM @extschema@.outbox_config();
    IF max_events IS NULL OR max_events < 1 OR max_events > cfg.max_claim THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('outbox_claim: max_events must be between 1 and %s (outbox.max_claim)', cfg.max_claim),
            DETAIL = format('max_events = %s', coalesce(max_events::text, 'NULL'));
    END IF;
    token := nextval('@extschema@.outbox_claim_token_seq');
    -- The stream first, while the claim holds no row lock: its waits (the stream's lock, a key
    -- row being inserted) then never close a cycle (docs/design.md, "Lock order"). Due tracked
    -- work keeps up to half of the batch, so retries and held keys never starve behind a backlog.
    due_tracked := (SELECT count(*) FROM (SELECT 1 FROM @extschema@.outbox_tracked e
                                            WHERE e.status = 'WAIT' AND NOT e.ordered AND e.next_retry_time <= stamp
                                            LIMIT max_events) u)
                 + (SELECT count(*) FROM (SELECT 1 FROM @extschema@.outbox_key k
                                            WHERE k.due_at <= stamp AND k.due_at > '-infinity'
                                            LIMIT max_events) k);
    IF max_events - least(due_tracked, (max_events + 1) / 2) > 0 THEN
        stream_ids := @extschema@.outbox_stream_take(owner, token, stamp,
                                                     max_events - least(due_tracked, (max_events + 1) / 2));
    END IF;
    IF cardinality(stream_ids) < max_events THEN
        tracked_ids := @extschema@.outbox_claim_tracked(owner, token, stamp, max_events - cardinality(stream_ids));
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
    IF (cardinality(tracked_ids) > 0 OR cardinality(stream_ids) > 0)
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
          FROM @extschema@.outbox_tracked t WHERE t.id = ANY (tracked_ids)
        UNION ALL
        SELECT s.id, s.topic, s.event_key, s.event_type, s.payload, s.headers,
               'SENDING'::@extschema@.outbox_status, 0, s.created_at, owner, token, stamp,
               NULL::text, s.created_at, stamp, s.event_id, s.key_hash IS NOT NULL, NULL::timestamptz
          FROM (SELECT r.* FROM @extschema@.outbox_stream r
                 WHERE r.id BETWEEN lo_id AND hi_id
                 OFFSET 0) s -- a fence: the id list filters the range, it does not drive the scan
          JOIN unnest(stream_ids) u(id) ON u.id = s.id -- hashed, not a search of the list per row
         WHERE lo_id IS NOT NULL
        UNION ALL
        SELECT s.id, s.topic, s.event_key, s.event_type, s.payload, s.headers,
               'SENDING'::@extschema@.outbox_status, 0, s.created_at, owner, token, stamp,
               NULL::text, s.created_at, stamp, s.event_id, s.key_hash IS NOT NULL, NULL::timestamptz
          FROM @extschema@.outbox_stream s
         WHERE lo_id IS NULL AND s.id = ANY (stream_ids)
    ) e
    ORDER BY e.id;
END
$$;

CREATE FUNCTION @extschema@.outbox_ack(owner text, claim_token bigint, ids bigint[])
RETURNS int
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Only the primary key's index scan takes row locks in id order (see the body).
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
#variable_conflict use_variable
DECLARE
    stamp timestamptz := clock_timestamp();
    done int;
BEGIN
    PERFORM @extschema@.outbox_check_claim_args('outbox_ack', owner, claim_token, ids);
    -- Row locks in id order, the one order of every statement that may wait for a row lock
    -- (reclaim, purge and claim never wait: SKIP LOCKED). Two orders could deadlock. The UPDATE
    -- takes them itself, by a primary-key scan that walks the sorted ids: the SET clauses rule
    -- out sequential and bitmap scans, and status::text keeps the planner off the lease index
    -- (claimed_at order), whose predicate it can no longer prove. sql_claim_plan checks it. A
    -- SELECT ... FOR UPDATE first would cost a second WAL record per row (docs/reference.md,
    -- "Life-cycle cost").
    WITH settled AS (
        UPDATE @extschema@.outbox_tracked e
           SET status = 'SUCCESS', updated_at = stamp
         WHERE e.id = ANY (ids) AND e.status::text = 'SENDING'
           AND e.claim_owner = owner AND e.claim_token = claim_token
        RETURNING e.topic, e.event_key, e.ordered
    ), woken AS (
        -- Their keys are due now: the next claim looks at each head (next run, backoff, dead head).
        -- No condition on due_at: it would lead the planner to a range scan that loops per key.
        UPDATE @extschema@.outbox_key k SET due_at = least(k.due_at, stamp)
          FROM (SELECT DISTINCT d.topic, d.event_key FROM settled d WHERE d.ordered) t
         WHERE k.topic = t.topic AND k.event_key = t.event_key
    )
    SELECT count(*) INTO done FROM settled;
    -- Stream events of this claim: out of its batch, nothing else to write (they are SUCCESS).
    RETURN done + cardinality(@extschema@.outbox_stream_settle(owner, claim_token, ids));
END
$$;

-- The retry rule, written once (nack and reclaim): after its n-th failed attempt an event is a
-- dead letter (FAIL) when n exceeds outbox.max_retry, else it waits for its next attempt.
CREATE FUNCTION @extschema@.outbox_status_after_failure(attempts int, max_retry int)
RETURNS @extschema@.outbox_status
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN attempts > max_retry THEN 'FAIL' ELSE 'WAIT' END::@extschema@.outbox_status
$$;

-- One failed attempt for the rows the caller still holds; returns each settled row with its new
-- state, so the caller knows which ones became dead letters without re-deriving the rule.
CREATE FUNCTION @extschema@.outbox_nack_returning(owner text, claim_token bigint, ids bigint[], error text DEFAULT NULL)
RETURNS TABLE (id bigint, topic text, status @extschema@.outbox_status, retry_count int, next_retry_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Only the primary key's index scan takes row locks in id order (see the body).
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
#variable_conflict use_variable
DECLARE
    cfg record;
    stamp timestamptz := clock_timestamp();
    held bigint[];
BEGIN
    PERFORM @extschema@.outbox_check_claim_args('outbox_nack', owner, claim_token, ids);
    SELECT * INTO cfg FROM @extschema@.outbox_config();
    -- Backoff after the n-th failure: min(n^2 * base, max) * (1 +/- jitter).
    -- Row locks in id order, taken by the UPDATE itself (status::text: see outbox_ack).
    RETURN QUERY
    WITH settled AS (
        UPDATE @extschema@.outbox_tracked e
           SET retry_count = e.retry_count + 1,
               status = @extschema@.outbox_status_after_failure(e.retry_count + 1, cfg.max_retry),
               next_retry_time = stamp + make_interval(secs =>
                   least(power(e.retry_count + 1, 2) * cfg.backoff_base_ms, cfg.backoff_max_ms)
                   * (1 + cfg.backoff_jitter * (2 * random() - 1)) / 1000.0),
               claim_owner = NULL, claim_token = NULL, claimed_at = NULL,
               -- A nack without a reason keeps the last one instead of erasing it.
               last_error = coalesce(error, e.last_error), updated_at = stamp
         WHERE e.id = ANY (ids) AND e.status::text = 'SENDING'
           AND e.claim_owner = owner AND e.claim_token = claim_token
        RETURNING e.id, e.topic, e.status, e.retry_count, e.next_retry_time, e.event_key, e.ordered
    ), woken AS (
        -- Their keys are due now: the next claim looks at each head (next run, backoff, dead head).
        -- No condition on due_at: it would lead the planner to a range scan that loops per key.
        UPDATE @extschema@.outbox_key k SET due_at = least(k.due_at, stamp)
          FROM (SELECT DISTINCT d.topic, d.event_key FROM settled d WHERE d.ordered) t
         WHERE k.topic = t.topic AND k.event_key = t.event_key
    )
    SELECT s.id, s.topic, s.status, s.retry_count, s.next_retry_time FROM settled s ORDER BY s.id;
    -- Stream events of this claim fail their first attempt: from here on their state lives in
    -- a tracked copy (same id and event_id), as any retried event's does.
    held := @extschema@.outbox_stream_settle(owner, claim_token, ids);
    IF cardinality(held) > 0 THEN
        RETURN QUERY
        WITH moved AS (
            INSERT INTO @extschema@.outbox_tracked AS m
                (id, topic, event_key, event_type, payload, headers, status, retry_count,
                 next_retry_time, last_error, created_at, updated_at, event_id, ordered)
            SELECT s.id, s.topic, s.event_key, s.event_type, s.payload, s.headers,
                   @extschema@.outbox_status_after_failure(1, cfg.max_retry), 1,
                   stamp + make_interval(secs =>
                       least(cfg.backoff_base_ms, cfg.backoff_max_ms)
                       * (1 + cfg.backoff_jitter * (2 * random() - 1)) / 1000.0),
                   error, s.created_at, stamp, s.event_id, s.key_hash IS NOT NULL
              FROM @extschema@.outbox_stream s
             WHERE s.id = ANY (held)
             ORDER BY s.id
            RETURNING m.id, m.topic, m.status, m.retry_count, m.next_retry_time
        )
        SELECT mv.id, mv.topic, mv.status, mv.retry_count, mv.next_retry_time FROM moved mv ORDER BY mv.id;
        PERFORM @extschema@.outbox_stream_key_rows(held, stamp);
    END IF;
END
$$;

-- outbox_nack_returning, counted: how many of the ids were still held and settled.
CREATE FUNCTION @extschema@.outbox_nack(owner text, claim_token bigint, ids bigint[], error text DEFAULT NULL)
RETURNS int
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT count(*)::int FROM @extschema@.outbox_nack_returning(owner, claim_token, ids, error)
$$;

CREATE FUNCTION @extschema@.outbox_renew(owner text, claim_token bigint, ids bigint[])
RETURNS int
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Only the primary key's index scan takes row locks in id order (see the body).
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
#variable_conflict use_variable
DECLARE
    stamp timestamptz := clock_timestamp();
    done int;
BEGIN
    PERFORM @extschema@.outbox_check_claim_args('outbox_renew', owner, claim_token, ids);
    -- Row locks in id order, taken by the UPDATE itself (status::text: see outbox_ack).
    UPDATE @extschema@.outbox_tracked e
       SET claimed_at = stamp, updated_at = stamp
     WHERE e.id = ANY (ids) AND e.status::text = 'SENDING'
       AND e.claim_owner = owner AND e.claim_token = claim_token;
    GET DIAGNOSTICS done = ROW_COUNT;
    -- Stream events: their claim's batch carries the lease.
    WITH renewed AS (
        UPDATE @extschema@.outbox_stream_batch b SET claimed_at = stamp
         WHERE b.claim_token = claim_token AND b.claim_owner = owner AND b.pending && ids
        RETURNING b.pending
    )
    SELECT done + coalesce(sum((SELECT count(*) FROM unnest(r.pending) p WHERE p = ANY (ids))), 0)
      INTO done FROM renewed r;
    RETURN done;
END
$$;

-- Hands held rows back WITHOUT counting a failed attempt: for failures that are not the event's
-- fault (broker unreachable, timeouts, not enough replicas). Fenced like nack; due after `delay`.
CREATE FUNCTION @extschema@.outbox_release(owner text, claim_token bigint, ids bigint[],
                                           delay interval DEFAULT '0', error text DEFAULT NULL)
RETURNS int
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Only the primary key's index scan takes row locks in id order (see the body).
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
#variable_conflict use_variable
DECLARE
    stamp timestamptz := clock_timestamp();
    done int;
    held bigint[];
BEGIN
    PERFORM @extschema@.outbox_check_claim_args('outbox_release', owner, claim_token, ids);
    IF delay IS NULL OR delay < interval '0' OR delay > interval '100 years' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_release: delay must be an interval from zero to 100 years',
            DETAIL = format('delay = %s', coalesce(delay::text, 'NULL'));
    END IF;
    -- Row locks in id order, taken by the UPDATE itself (status::text: see outbox_ack).
    WITH settled AS (
        UPDATE @extschema@.outbox_tracked e
           SET status = 'WAIT', next_retry_time = stamp + delay,
               claim_owner = NULL, claim_token = NULL, claimed_at = NULL,
               last_error = coalesce(error, e.last_error), updated_at = stamp
         WHERE e.id = ANY (ids) AND e.status::text = 'SENDING'
           AND e.claim_owner = owner AND e.claim_token = claim_token
        RETURNING e.topic, e.event_key, e.ordered
    ), woken AS (
        -- Their keys are due now: the next claim looks at each head (next run, backoff, dead head).
        -- No condition on due_at: it would lead the planner to a range scan that loops per key.
        UPDATE @extschema@.outbox_key k SET due_at = least(k.due_at, stamp)
          FROM (SELECT DISTINCT d.topic, d.event_key FROM settled d WHERE d.ordered) t
         WHERE k.topic = t.topic AND k.event_key = t.event_key
    )
    SELECT count(*) INTO done FROM settled;
    -- Stream events go back as tracked copies (same id and event_id), due after the delay.
    held := @extschema@.outbox_stream_settle(owner, claim_token, ids);
    IF cardinality(held) > 0 THEN
        INSERT INTO @extschema@.outbox_tracked
            (id, topic, event_key, event_type, payload, headers, status, retry_count,
             next_retry_time, last_error, created_at, updated_at, event_id, ordered)
        SELECT s.id, s.topic, s.event_key, s.event_type, s.payload, s.headers, 'WAIT', 0,
               stamp + delay, error, s.created_at, stamp, s.event_id, s.key_hash IS NOT NULL
          FROM @extschema@.outbox_stream s
         WHERE s.id = ANY (held)
         ORDER BY s.id;
        PERFORM @extschema@.outbox_stream_key_rows(held, stamp);
        done := done + cardinality(held);
    END IF;
    RETURN done;
END
$$;

-- Releases what `owner` holds under tokens other than `keep`, without counting an attempt: a
-- claim whose reply was lost (its connection died after the commit) left events whose token its
-- owner never learned, held until the lease while the owner keeps beating. Returns how many.
CREATE FUNCTION @extschema@.outbox_release_orphans(owner text, keep bigint[] DEFAULT '{}')
RETURNS int
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    orphan record;
    done int := 0;
BEGIN
    PERFORM @extschema@.outbox_check_isolation('outbox_release_orphans');
    PERFORM @extschema@.outbox_check_owner('outbox_release_orphans', owner);
    PERFORM @extschema@.outbox_check_ids('outbox_release_orphans', keep);
    FOR orphan IN
        SELECT o.token, array_agg(o.id ORDER BY o.id) AS ids
          FROM (SELECT t.claim_token AS token, t.id FROM @extschema@.outbox_tracked t
                 WHERE t.status = 'SENDING' AND t.claim_owner = owner
                UNION ALL
                SELECT b.claim_token, unnest(b.pending) FROM @extschema@.outbox_stream_batch b
                 WHERE b.claim_owner = owner) o
         WHERE (o.token = ANY (keep)) IS NOT TRUE
         GROUP BY o.token
         ORDER BY o.token
    LOOP
        done := done + @extschema@.outbox_release(owner, orphan.token, orphan.ids, '0',
                                                 'orphaned: the reply to its claim never reached its owner');
    END LOOP;
    RETURN done;
END
$$;

-- A claimer says it is alive until now + timeout, and beats again before then (the relay every
-- sixth of its timeout). Once an owner's expiry has passed without a new beat, outbox_reclaim
-- takes back the claims it made before that expiry, whatever their lease. A timeout of zero says
-- the owner stops: what it still holds goes at the next reclaim. A later beat revives the owner,
-- and its claims that were not reclaimed yet are its own again. Returns the expiry.
CREATE FUNCTION @extschema@.outbox_heartbeat(owner text, timeout interval DEFAULT '30 seconds')
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    -- Wall clock, as the claim's claimed_at: a beat inside a long transaction is still now.
    stamp timestamptz := clock_timestamp();
BEGIN
    PERFORM @extschema@.outbox_check_owner('outbox_heartbeat', owner);
    -- The upper bound keeps stamp + timeout inside timestamptz's range.
    IF timeout IS NULL OR timeout < interval '0' OR timeout > interval '100 years' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_heartbeat: timeout must be an interval from 0 to 100 years',
            DETAIL = format('timeout = %s', coalesce(timeout::text, 'NULL'));
    END IF;
    INSERT INTO @extschema@.outbox_owner AS o (owner, started_at, beat_at, expires_at)
    VALUES (owner, stamp, stamp, stamp + timeout)
    ON CONFLICT ON CONSTRAINT outbox_owner_pkey
    DO UPDATE SET beat_at = excluded.beat_at, expires_at = excluded.expires_at;
    RETURN stamp + timeout;
END
$$;

-- The claimers, for operators (outbox-worker relays): every owner with a heartbeat row or a
-- claim, whether it is alive (NULL: it never beat, so its claims go back after their lease only),
-- and how many events it holds since when.
CREATE FUNCTION @extschema@.outbox_owners(max_rows int DEFAULT 100)
RETURNS TABLE (owner text, alive boolean, started_at timestamptz, beat_at timestamptz,
               expires_at timestamptz, held bigint, oldest_claim timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    stamp timestamptz := clock_timestamp();
BEGIN
    IF max_rows IS NULL OR max_rows < 1 OR max_rows > 100000 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_owners: max_rows must be between 1 and 100000',
            DETAIL = format('max_rows = %s', coalesce(max_rows::text, 'NULL'));
    END IF;
    RETURN QUERY
    WITH claims AS (
        SELECT t.claim_owner AS who, count(*) AS n, min(t.claimed_at) AS since
          FROM @extschema@.outbox_tracked t
         WHERE t.status = 'SENDING'
         GROUP BY t.claim_owner
        UNION ALL
        -- From the floor on (outbox_stream_cursor.batch_floor): below it every batch is settled.
        SELECT b.claim_owner, sum(cardinality(b.pending)), min(b.claimed_at)
          FROM @extschema@.outbox_stream_batch b
         WHERE b.claim_token >= (SELECT v.batch_floor FROM @extschema@.outbox_stream_cursor v
                                  ORDER BY v.version DESC LIMIT 1)
         GROUP BY b.claim_owner
    ), holders AS (
        SELECT c.who, sum(c.n)::bigint AS n, min(c.since) AS since FROM claims c GROUP BY c.who
    )
    SELECT coalesce(o.owner, h.who), o.expires_at >= stamp, o.started_at, o.beat_at, o.expires_at,
           coalesce(h.n, 0), h.since
      FROM @extschema@.outbox_owner o
      FULL JOIN holders h ON h.who = o.owner
     ORDER BY 1
     LIMIT max_rows;
END
$$;

-- Why outbox_reclaim takes back a claim that owner made at claimed_at, as its last_error, or NULL
-- when it does not: the lease ended, or the owner's heartbeat ran out after it claimed (gone_owners
-- and gone_at: the owners whose heartbeat has run out, and when).
CREATE FUNCTION @extschema@.outbox_reclaim_reason(owner text, claimed_at timestamptz,
                                                  stamp timestamptz, lease interval,
                                                  gone_owners text[], gone_at timestamptz[])
RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN claimed_at < stamp - lease
                THEN format('lease expired: claimed by %s at %s, not settled within %s',
                            owner, claimed_at, lease)
                WHEN claimed_at <= g.at
                THEN format('owner gone: claimed by %s at %s, whose heartbeat ran out at %s',
                            owner, claimed_at, g.at)
           END
      FROM (SELECT gone_at[array_position(gone_owners, owner)] AS at) g
$$;

-- Expired claims back to WAIT (or FAIL): claims past their lease, and claims whose owner's
-- heartbeat ran out (outbox_heartbeat). Returns each reclaimed row with its new state and the
-- owner that held it, so the caller can log and count the dead letters it made.
CREATE FUNCTION @extschema@.outbox_reclaim_returning(lease interval DEFAULT NULL)
RETURNS TABLE (id bigint, topic text, status @extschema@.outbox_status, retry_count int, expired_owner text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cfg record;
    stamp timestamptz := clock_timestamp();
    done int;
    moved_rows int;
    gone_owners text[];
    gone_at timestamptz[];
BEGIN
    PERFORM @extschema@.outbox_check_isolation('outbox_reclaim');
    SELECT * INTO cfg FROM @extschema@.outbox_config();
    lease := coalesce(lease, make_interval(secs => cfg.lease_ms / 1000.0));
    -- The upper bound keeps stamp - lease inside timestamptz's range (else 22008 from deep inside).
    IF lease <= interval '0' OR lease > interval '100 years' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_reclaim: lease must be a positive interval of at most 100 years',
            DETAIL = format('lease = %s', lease);
    END IF;
    -- Guarded by status and claimed_at in the same statement: a row acked, nacked or renewed
    -- while this runs no longer matches and is left alone. A reclaim counts as a failed attempt,
    -- so a poison event that kills its relay every time still ends as a dead letter.
    -- SKIP LOCKED: a row locked right now is being settled by its holder; never wait for it
    -- (waiting in claimed_at order against acks in id order could deadlock).
    -- Owners whose heartbeat ran out (outbox_heartbeat), with when it did: their claims made
    -- before then go now (outbox_reclaim_reason). Few rows, read whole.
    SELECT coalesce(array_agg(o.owner), '{}'), coalesce(array_agg(o.expires_at), '{}')
      INTO gone_owners, gone_at
      FROM @extschema@.outbox_owner o
     WHERE o.expires_at < stamp;
    RETURN QUERY
    WITH expired AS MATERIALIZED (
        SELECT x.id, x.claim_owner FROM @extschema@.outbox_tracked x
         WHERE x.status = 'SENDING'
           AND @extschema@.outbox_reclaim_reason(x.claim_owner, x.claimed_at, stamp, lease,
                                                 gone_owners, gone_at) IS NOT NULL
         ORDER BY x.id
         FOR UPDATE SKIP LOCKED
    ), reclaimed AS (
        UPDATE @extschema@.outbox_tracked e
           SET retry_count = e.retry_count + 1,
               status = @extschema@.outbox_status_after_failure(e.retry_count + 1, cfg.max_retry),
               next_retry_time = stamp,
               last_error = @extschema@.outbox_reclaim_reason(e.claim_owner, e.claimed_at, stamp,
                                                              lease, gone_owners, gone_at),
               claim_owner = NULL, claim_token = NULL, claimed_at = NULL, updated_at = stamp
         -- Locked above, so still as expired saw them; the state is checked again all the same.
         WHERE e.id = ANY (ARRAY(SELECT expired.id FROM expired)) AND e.status = 'SENDING'
           AND @extschema@.outbox_reclaim_reason(e.claim_owner, e.claimed_at, stamp, lease,
                                                 gone_owners, gone_at) IS NOT NULL
        RETURNING e.id, e.topic, e.status, e.retry_count, e.event_key, e.ordered
    ), woken AS (
        -- Their keys are due now: the next claim looks at each head (next run, backoff, dead head).
        -- No condition on due_at: it would lead the planner to a range scan that loops per key.
        UPDATE @extschema@.outbox_key k SET due_at = least(k.due_at, stamp)
          FROM (SELECT DISTINCT d.topic, d.event_key FROM reclaimed d WHERE d.ordered) t
         WHERE k.topic = t.topic AND k.event_key = t.event_key
    )
    SELECT r.id, r.topic, r.status, r.retry_count, x.claim_owner
      FROM reclaimed r JOIN expired x ON x.id = r.id
     ORDER BY r.id;
    GET DIAGNOSTICS done = ROW_COUNT;
    -- Stream batches past their lease, or whose owner is gone: their events become tracked copies
    -- (same id and event_id) after one failed attempt. SKIP LOCKED: a batch locked right now is being settled.
    RETURN QUERY
    WITH expired AS MATERIALIZED (
        SELECT b.claim_token, b.claim_owner, b.pending, r.why
          FROM @extschema@.outbox_stream_batch b
         CROSS JOIN LATERAL (SELECT @extschema@.outbox_reclaim_reason(b.claim_owner, b.claimed_at, stamp,
                                                                      lease, gone_owners, gone_at) AS why) r
         WHERE r.why IS NOT NULL
           -- From the floor on (outbox_stream_cursor.batch_floor): below it every batch is settled.
           AND b.claim_token >= (SELECT v.batch_floor FROM @extschema@.outbox_stream_cursor v
                                  ORDER BY v.version DESC LIMIT 1)
         ORDER BY b.claim_token
         FOR UPDATE OF b SKIP LOCKED
    ), gone AS (
        DELETE FROM @extschema@.outbox_stream_batch b
         USING expired x
         WHERE b.claim_token = x.claim_token
    ), held AS (
        SELECT p.id, x.claim_owner, x.why
          FROM expired x CROSS JOIN LATERAL unnest(x.pending) AS p(id)
    ), moved AS (
        INSERT INTO @extschema@.outbox_tracked AS m
            (id, topic, event_key, event_type, payload, headers, status, retry_count,
             next_retry_time, last_error, created_at, updated_at, event_id, ordered)
        SELECT s.id, s.topic, s.event_key, s.event_type, s.payload, s.headers,
               @extschema@.outbox_status_after_failure(1, cfg.max_retry), 1, stamp, h.why,
               s.created_at, stamp, s.event_id, s.key_hash IS NOT NULL
          FROM held h JOIN @extschema@.outbox_stream s ON s.id = h.id
         ORDER BY s.id
        RETURNING m.id, m.topic, m.status, m.retry_count
    ), key_rows AS (
        -- The ordered ones' key rows, as outbox_stream_key_rows writes them.
        INSERT INTO @extschema@.outbox_key AS k (topic, event_key, due_at)
        SELECT DISTINCT s.topic, s.event_key, stamp
          FROM held h JOIN @extschema@.outbox_stream s ON s.id = h.id
         WHERE s.key_hash IS NOT NULL
         ORDER BY 1, 2
        ON CONFLICT ON CONSTRAINT outbox_key_pkey DO UPDATE SET due_at = least(k.due_at, excluded.due_at)
    )
    SELECT mv.id, mv.topic, mv.status, mv.retry_count, h.claim_owner
      FROM moved mv JOIN held h ON h.id = mv.id
     ORDER BY mv.id;
    GET DIAGNOSTICS moved_rows = ROW_COUNT;
    done := done + moved_rows;
    -- Owners gone for longer than a lease hold nothing the lease has not taken back (a claim
    -- skipped above as locked included): their rows go, so the table stays as small as the
    -- set of live claimers.
    IF cardinality(gone_owners) > 0 THEN
        DELETE FROM @extschema@.outbox_owner o WHERE o.expires_at < stamp - lease;
    END IF;
    IF done > 0 AND cfg.notify THEN
        PERFORM pg_notify('outbox', '');
    END IF;
END
$$;

-- outbox_reclaim_returning, counted.
CREATE FUNCTION @extschema@.outbox_reclaim(lease interval DEFAULT NULL)
RETURNS int
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT count(*)::int FROM @extschema@.outbox_reclaim_returning(lease)
$$;

CREATE FUNCTION @extschema@.outbox_requeue(ids bigint[])
RETURNS int
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cfg record;
    stamp timestamptz := clock_timestamp();
    done int;
BEGIN
    PERFORM @extschema@.outbox_check_isolation('outbox_requeue');
    PERFORM @extschema@.outbox_check_ids('outbox_requeue', ids);
    SELECT * INTO cfg FROM @extschema@.outbox_config();
    -- last_error is kept: it is the operator's record of why the event had failed.
    WITH dead AS MATERIALIZED (
        SELECT d.id FROM @extschema@.outbox_tracked d
         WHERE d.id = ANY (ids) AND d.status = 'FAIL'
         ORDER BY d.id
         FOR UPDATE
    ), revived AS (
        UPDATE @extschema@.outbox_tracked e
           SET status = 'WAIT', retry_count = 0, next_retry_time = stamp, skipped_at = NULL,
               updated_at = stamp
         WHERE e.id = ANY (ARRAY(SELECT dead.id FROM dead)) AND e.status = 'FAIL'
        RETURNING e.topic, e.event_key, e.ordered
    ), woken AS (
        -- A blocked key resumes with its requeued head; under the skip policy its row may be gone.
        INSERT INTO @extschema@.outbox_key AS k (topic, event_key, due_at)
        SELECT DISTINCT r.topic, r.event_key, stamp FROM revived r WHERE r.ordered
         ORDER BY 1, 2
        ON CONFLICT (topic, event_key) DO UPDATE SET due_at = least(k.due_at, excluded.due_at)
    )
    SELECT count(*) INTO done FROM revived;
    IF done > 0 AND cfg.notify THEN
        PERFORM pg_notify('outbox', '');
    END IF;
    RETURN done;
END
$$;

-- Keys held back by a dead head (outbox.head_of_line = block): the head, since when it is dead
-- and why, and how many events wait behind it. Oldest first.
CREATE FUNCTION @extschema@.outbox_blocked_keys(max_rows int DEFAULT 100)
RETURNS TABLE (topic text, event_key text, head_id bigint, blocked_since timestamptz,
               last_error text, waiting bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF max_rows IS NULL OR max_rows < 1 OR max_rows > 100000 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_blocked_keys: max_rows must be between 1 and 100000',
            DETAIL = format('max_rows = %s', coalesce(max_rows::text, 'NULL'));
    END IF;
    -- A claim marks a key blocked ('infinity') when it finds its head dead.
    RETURN QUERY
    SELECT k.topic, k.event_key, h.id, h.updated_at, h.last_error,
           (SELECT count(*) FROM @extschema@.outbox_tracked w
             WHERE w.topic = k.topic AND w.event_key = k.event_key AND w.ordered
               AND w.status <> 'SUCCESS' AND w.status = 'WAIT' AND w.id > h.id)
      FROM @extschema@.outbox_key k
      CROSS JOIN LATERAL (
          SELECT e.id, e.updated_at, e.last_error FROM @extschema@.outbox_tracked e
           WHERE e.topic = k.topic AND e.event_key = k.event_key AND e.ordered
             AND e.status <> 'SUCCESS'
           ORDER BY e.id
           LIMIT 1
      ) h
     WHERE k.due_at = 'infinity'
     ORDER BY h.updated_at, k.topic, k.event_key
     LIMIT max_rows;
END
$$;

-- Lets the keys of these dead letters go on without them (outbox.head_of_line = block): they
-- stay FAIL, listed as dead letters, and can still be requeued (then published out of order).
CREATE FUNCTION @extschema@.outbox_skip(ids bigint[])
RETURNS int
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    stamp timestamptz := clock_timestamp();
    done int;
BEGIN
    PERFORM @extschema@.outbox_check_isolation('outbox_skip');
    PERFORM @extschema@.outbox_check_ids('outbox_skip', ids);
    WITH dead AS MATERIALIZED (
        SELECT d.id FROM @extschema@.outbox_tracked d
         WHERE d.id = ANY (ids) AND d.status = 'FAIL' AND d.skipped_at IS NULL
         ORDER BY d.id
         FOR UPDATE
    ), settled AS (
        UPDATE @extschema@.outbox_tracked e SET skipped_at = stamp, updated_at = stamp
         WHERE e.id = ANY (ARRAY(SELECT dead.id FROM dead)) AND e.status = 'FAIL'
        RETURNING e.topic, e.event_key, e.ordered
    ), woken AS (
        UPDATE @extschema@.outbox_key k SET due_at = least(k.due_at, stamp)
          FROM (SELECT DISTINCT d.topic, d.event_key FROM settled d WHERE d.ordered) t
         WHERE k.topic = t.topic AND k.event_key = t.event_key
    )
    SELECT count(*) INTO done FROM settled;
    RETURN done;
END
$$;

CREATE FUNCTION @extschema@.outbox_purge(older_than interval DEFAULT '7 days', max_rows int DEFAULT 10000)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Planned per call: with the real cutoff the planner walks the SUCCESS index; a generic plan
-- (unknown cutoff) may scan the whole history instead (test: purge_reads_only_the_rows_it_deletes).
SET plan_cache_mode = force_custom_plan
-- The DELETE takes its row locks through the primary key, in id order (see the body).
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
    done bigint;
    stream_done bigint;
BEGIN
    PERFORM @extschema@.outbox_check_isolation('outbox_purge');
    IF older_than IS NULL OR older_than < interval '0' OR older_than > interval '100 years' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_purge: older_than must be an interval from zero to 100 years',
            DETAIL = format('older_than = %s', coalesce(older_than::text, 'NULL'));
    END IF;
    IF max_rows IS NULL OR max_rows < 1 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_purge: max_rows must be at least 1',
            DETAIL = format('max_rows = %s', coalesce(max_rows::text, 'NULL'));
    END IF;
    -- Only SUCCESS rows, re-checked in the DELETE itself; FAIL rows wait for an operator.
    -- The oldest first through the partial index on SUCCESS rows by age, so the cost follows
    -- the rows deleted. No SELECT ... FOR UPDATE first (a WAL record per row): the DELETE locks
    -- the rows itself, in id order through the primary key (status::text keeps the planner off
    -- the SUCCESS index, whose order is the rows' age), and nothing but another purge locks a
    -- SUCCESS row. Two purges at once: the second waits for the first's rows, finds them gone
    -- and deletes the rest of its pick.
    WITH old AS MATERIALIZED (
        SELECT s.id FROM @extschema@.outbox_tracked s
         WHERE s.status = 'SUCCESS' AND s.updated_at < now() - older_than
         ORDER BY s.updated_at
         LIMIT max_rows
    )
    , gone AS (
        DELETE FROM @extschema@.outbox_tracked e
         WHERE e.id = ANY (ARRAY(SELECT old.id FROM old)) AND e.status::text = 'SUCCESS'
        RETURNING e.id
    ), originals AS (
        -- A stream event's first row goes with its tracked copy (a retry, a busy key's event).
        DELETE FROM @extschema@.outbox_stream s
         WHERE s.id = ANY (ARRAY(SELECT g.id FROM gone g))
        RETURNING s.id
    )
    SELECT count(*) INTO done FROM gone;
    -- Stream rows: handed out, held by no claim (a retried one's tracked copy stands for it) and
    -- older than the cutoff. Among the oldest max_rows ids only, so a purge never walks a backlog
    -- to find nothing: ids follow time closely enough for retention.
    IF done < max_rows THEN
        WITH c AS (
            SELECT v.prev_snap, v.cur_snap, v.pos_id, v.batch_floor
              FROM @extschema@.outbox_stream_cursor v ORDER BY v.version DESC LIMIT 1
        ), unsettled AS MATERIALIZED (
            -- The ids of unsettled batches, read once from the floor on.
            SELECT p.id FROM c, @extschema@.outbox_stream_batch b, unnest(b.pending) AS p(id)
             WHERE b.claim_token >= c.batch_floor
        ), old AS MATERIALIZED (
            SELECT h.id
              FROM (SELECT e.id, e.txid, e.created_at FROM @extschema@.outbox_stream e
                     ORDER BY e.id LIMIT max_rows - done) h, c
             WHERE h.created_at < now() - older_than
               AND @extschema@.outbox_stream_passed(h.txid, h.id, c.prev_snap, c.cur_snap, c.pos_id)
               AND NOT EXISTS (SELECT 1 FROM unsettled u WHERE u.id = h.id)
               AND NOT EXISTS (SELECT 1 FROM @extschema@.outbox_tracked t WHERE t.id = h.id)
        )
        DELETE FROM @extschema@.outbox_stream e WHERE e.id = ANY (ARRAY(SELECT old.id FROM old));
        GET DIAGNOSTICS stream_done = ROW_COUNT;
        done := done + stream_done;
    END IF;
    RETURN done;
END
$$;

CREATE FUNCTION @extschema@.outbox_dead_letters(max_rows int DEFAULT 100, after_id bigint DEFAULT 0)
RETURNS SETOF @extschema@.outbox_event
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF max_rows IS NULL OR max_rows < 1 OR max_rows > 100000 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_dead_letters: max_rows must be between 1 and 100000',
            DETAIL = format('max_rows = %s', coalesce(max_rows::text, 'NULL'));
    END IF;
    RETURN QUERY
    SELECT e.id, e.topic, e.event_key, e.event_type, e.payload, e.headers, e.status, e.retry_count,
           e.next_retry_time, e.claim_owner, e.claim_token, e.claimed_at, e.last_error, e.created_at,
           e.updated_at, e.event_id, e.ordered, e.skipped_at
      FROM @extschema@.outbox_tracked e
     WHERE e.status = 'FAIL' AND e.id > coalesce(after_id, 0)
     ORDER BY e.id
     LIMIT max_rows;
END
$$;

CREATE FUNCTION @extschema@.outbox_stats(
    OUT due_wait bigint,
    OUT delayed_wait bigint,
    OUT sending bigint,
    OUT failed bigint,
    OUT succeeded bigint,
    OUT oldest_due_age interval,
    OUT oldest_lease_age interval,
    OUT blocked_keys bigint,
    OUT oldest_blocked_age interval
)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    stamp timestamptz := clock_timestamp();
    -- Below this size (both tables together, or one table) a count is cheap.
    small constant bigint := 8 * 1024 * 1024;
    est bigint;
    stream_wait bigint;
    stream_oldest timestamptz;
BEGIN
    -- Loads the library (and so the outbox.* settings) for relays that read them after this call.
    PERFORM @extschema@.outbox_config();
    -- Every count below reads a partial index whose size follows the backlog, not the history
    -- (WAIT rows: the unordered ones' and the ordered keys' index).
    SELECT count(*) FILTER (WHERE w.next_retry_time <= stamp),
           count(*) FILTER (WHERE w.next_retry_time > stamp),
           stamp - min(w.next_retry_time) FILTER (WHERE w.next_retry_time <= stamp)
      INTO due_wait, delayed_wait, oldest_due_age
      FROM (SELECT e.next_retry_time FROM @extschema@.outbox_tracked e
             WHERE e.status = 'WAIT' AND NOT e.ordered
            UNION ALL
            SELECT e.next_retry_time FROM @extschema@.outbox_tracked e
             WHERE e.ordered AND e.status <> 'SUCCESS' AND e.status = 'WAIT') w;
    -- Stream events past the cursor (committed ones: a plain read sees no other), read as
    -- outbox_stream_take reads them, so the cost follows the backlog.
    SELECT count(*), min(w.created_at) INTO stream_wait, stream_oldest
      FROM (SELECT v.* FROM @extschema@.outbox_stream_cursor v ORDER BY v.version DESC LIMIT 1) c
      CROSS JOIN LATERAL (
          SELECT e.created_at FROM @extschema@.outbox_stream e
           WHERE e.id IN (SELECT r.id FROM @extschema@.outbox_stream_walk(c.prev_snap, c.cur_snap, c.pos_id,
                                                                          c.win_lo, c.win_hi, NULL) r)
          UNION ALL
          SELECT e.created_at FROM @extschema@.outbox_stream e WHERE e.txid >= pg_snapshot_xmax(c.cur_snap)
          UNION ALL
          SELECT e.created_at FROM pg_snapshot_xip(c.cur_snap) x
           CROSS JOIN LATERAL (SELECT e.created_at FROM @extschema@.outbox_stream e
                                WHERE e.txid = x OFFSET 0) e
      ) w;
    due_wait := due_wait + stream_wait;
    oldest_due_age := CASE WHEN stream_oldest IS NULL THEN oldest_due_age
                           ELSE greatest(oldest_due_age, stamp - stream_oldest) END;
    SELECT count(*), stamp - min(e.claimed_at)
      INTO sending, oldest_lease_age
      FROM @extschema@.outbox_tracked e WHERE e.status = 'SENDING';
    SELECT sending + coalesce(sum(cardinality(b.pending)), 0),
           greatest(oldest_lease_age, stamp - min(b.claimed_at))
      INTO sending, oldest_lease_age
      FROM @extschema@.outbox_stream_batch b
     WHERE b.claim_token >= (SELECT v.batch_floor FROM @extschema@.outbox_stream_cursor v
                              ORDER BY v.version DESC LIMIT 1);
    SELECT count(*) INTO failed FROM @extschema@.outbox_tracked e WHERE e.status = 'FAIL';
    -- Keys held back by a dead head, and since when that head has been dead.
    SELECT count(*), stamp - min(h.updated_at)
      INTO blocked_keys, oldest_blocked_age
      FROM @extschema@.outbox_key k
      CROSS JOIN LATERAL (
          SELECT e.updated_at FROM @extschema@.outbox_tracked e
           WHERE e.topic = k.topic AND e.event_key = k.event_key AND e.ordered
             AND e.status <> 'SUCCESS'
           ORDER BY e.id
           LIMIT 1
      ) h
     WHERE k.due_at = 'infinity';
    -- SUCCESS rows are the history: count them exactly while the tables are small, estimate
    -- from the planner's statistics (reltuples) beyond that.
    IF pg_relation_size('@extschema@.outbox_tracked'::regclass)
       + pg_relation_size('@extschema@.outbox_stream'::regclass) < small THEN
        SELECT count(*) INTO succeeded FROM @extschema@.outbox_event e WHERE e.status = 'SUCCESS';
    ELSE
        -- A table never vacuumed nor analyzed has no estimate (-1): count its rows while it is
        -- small, else take it as empty until autovacuum has seen it (an exact count would read
        -- the whole stream's history).
        SELECT sum(CASE WHEN c.reltuples >= 0 THEN c.reltuples::bigint
                        WHEN pg_relation_size(c.oid) >= small THEN 0
                        WHEN c.oid = '@extschema@.outbox_tracked'::regclass
                        THEN (SELECT count(*) FROM @extschema@.outbox_tracked)
                        ELSE (SELECT count(*) FROM @extschema@.outbox_stream) END)
          INTO est
          FROM pg_class c
         WHERE c.oid IN ('@extschema@.outbox_tracked'::regclass, '@extschema@.outbox_stream'::regclass);
        succeeded := greatest(est - due_wait - delayed_wait - sending - failed, 0);
    END IF;
END
$$;
