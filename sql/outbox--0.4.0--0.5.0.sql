-- outbox 0.4.0 -> 0.5.0 (docs/reference.md, "Wake-up", "Bulk enqueue" and "Upgrades").
-- * outbox_wait(timeout): the relay's wake-up without LISTEN/NOTIFY. With shared_preload_libraries
--   = 'outbox' a commit that enqueued wakes waiters at once (shared memory and latches, no lock);
--   without, it looks at the queue every outbox.wait_poll_interval (10 ms).
-- * outbox.notify now defaults to off (the setting lives in the library): NOTIFY made notifying
--   transactions commit one at a time. Relays before 0.5.0 fall back to their poll interval.
-- * outbox_enqueue_many: many events of a topic in one call, all or nothing.
-- * outbox_enqueue: one Rust call for its topic checks, one statement for an ordered event.
-- * outbox_claim reads outbox.head_of_line with missing_ok (the same body serves the SQL-only build).
-- Events in flight are untouched: no table changes.
\echo Use "ALTER EXTENSION outbox UPDATE TO '0.5.0'" to load this file. \quit

CREATE FUNCTION @extschema@."outbox_enqueue_begin"("topic" TEXT, "key" TEXT) RETURNS bool
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'outbox_enqueue_begin_wrapper';

CREATE FUNCTION @extschema@."outbox_wait_for"("timeout_ms" bigint, "work_due" oid) RETURNS bool
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'outbox_wait_for_wrapper';

CREATE FUNCTION @extschema@."outbox_wake_mode"() RETURNS TEXT
STRICT STABLE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'outbox_wake_mode_wrapper';

-- The advisory lock that makes producers of one (topic, key) take turns until they commit
-- (outbox_enqueue), and that a claim takes before deleting an idle key. One of 1,024 locks by the
-- key's hash, so a transaction holds at most 1,024 of them however many keys it enqueues for
-- (PostgreSQL's lock table is small and shared); the high 32 bits ('outb') keep them apart from
-- an application's small advisory lock numbers. Topics never contain '/'.
CREATE OR REPLACE FUNCTION @extschema@.outbox_key_lock_id(topic text, event_key text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
-- No SET clause, so the planner inlines it into its callers (an enqueue hot path); every operator
-- is named with its schema instead, so no search_path can redirect it.
AS $$
    SELECT 8031453474740764672::pg_catalog.int8 OPERATOR(pg_catalog.+)
           (pg_catalog.hashtextextended(topic OPERATOR(pg_catalog.||) '/' OPERATOR(pg_catalog.||) event_key, 7964)
            OPERATOR(pg_catalog.&) 1023)
$$;

CREATE OR REPLACE FUNCTION @extschema@.outbox_enqueue(
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

    IF ordered THEN
        -- One statement (each costs an executor start): first the key's turn, an advisory lock
        -- producers of this key hold until they commit, so the id drawn after it follows commit
        -- order within the key (a sequence alone does not: docs/reference.md); then the event; then
        -- the key's row if the key was idle (an active key has one, and its head decides when it
        -- is due).
        WITH turn AS (
            SELECT pg_advisory_xact_lock(@extschema@.outbox_key_lock_id(topic, key))
        ), event AS (
            INSERT INTO @extschema@.outbox_event
                (topic, event_key, event_type, payload, headers, status, next_retry_time, ordered)
            SELECT topic, key, event_type, payload, headers, 'WAIT', greatest(now(), deliver_at), true
              FROM turn
            RETURNING id
        ), key_row AS (
            INSERT INTO @extschema@.outbox_key (topic, event_key, due_at)
            SELECT topic, key, greatest(now(), deliver_at) FROM event
            ON CONFLICT DO NOTHING
        )
        SELECT event.id INTO new_id FROM event;
    ELSE
        INSERT INTO @extschema@.outbox_event
            (topic, event_key, event_type, payload, headers, status, next_retry_time, ordered)
        VALUES
            (topic, key, event_type, payload, headers, 'WAIT', greatest(now(), deliver_at), false)
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

    IF ordered_topic THEN
        -- Every key's turn (outbox_enqueue), taken in lock order so that two batches sharing
        -- keys wait for each other instead of deadlocking.
        PERFORM pg_advisory_xact_lock(l.id)
           FROM (SELECT DISTINCT @extschema@.outbox_key_lock_id(topic, k) AS id
                   FROM unnest(keys) k WHERE k IS NOT NULL ORDER BY 1) l;
    END IF;
    RETURN QUERY
    WITH event AS (
        INSERT INTO @extschema@.outbox_event
            (topic, event_key, event_type, payload, headers, status, next_retry_time, ordered)
        SELECT topic, u.k, u.t, u.p, coalesce(u.h, '{}'::jsonb), 'WAIT', greatest(now(), deliver_at),
               ordered_topic AND u.k IS NOT NULL
          FROM unnest(payloads, keys, event_types, headers) WITH ORDINALITY u(p, k, t, h, pos)
         ORDER BY u.pos
        RETURNING id, event_key, ordered
    ), key_row AS (
        INSERT INTO @extschema@.outbox_key (topic, event_key, due_at)
        SELECT DISTINCT topic, event.event_key, greatest(now(), deliver_at) FROM event WHERE event.ordered
        ON CONFLICT DO NOTHING
    )
    SELECT event.id FROM event ORDER BY event.id;

    IF @extschema@.outbox_notify_enabled() AND n > 0 THEN
        PERFORM pg_notify('outbox', '');
    END IF;
END
$$;

-- Whether a claim would find something now: a due unordered event, or a due key (one that looked
-- idle counts only once an event of it waits, else a producer still in its transaction would keep
-- it "due" and waiters would spin). outbox_wait's look at the queue: two index probes.
CREATE FUNCTION @extschema@.outbox_work_due() RETURNS boolean
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT EXISTS (SELECT 1 FROM @extschema@.outbox_event e
                    WHERE e.status = 'WAIT' AND NOT e.ordered AND e.next_retry_time <= clock_timestamp())
        OR EXISTS (SELECT 1 FROM @extschema@.outbox_key k
                    WHERE k.due_at <= clock_timestamp()
                      AND (k.due_at > '-infinity'
                           OR EXISTS (SELECT 1 FROM @extschema@.outbox_event e
                                       WHERE e.topic = k.topic AND e.event_key = k.event_key
                                         AND e.ordered AND e.status = 'WAIT')))
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

REVOKE ALL ON FUNCTION
    @extschema@.outbox_enqueue_begin(text, text),
    @extschema@.outbox_enqueue_many(text, jsonb[], text[], text[], jsonb[], timestamptz),
    @extschema@.outbox_work_due(),
    @extschema@.outbox_wait(interval),
    @extschema@.outbox_wait_for(bigint, oid),
    @extschema@.outbox_wake_mode()
FROM PUBLIC;

-- outbox_claim reads outbox.head_of_line with missing_ok, so the SQL-only build (scripts/sql-only),
-- which registers no settings, runs the same body.
CREATE OR REPLACE FUNCTION @extschema@.outbox_claim(owner text, max_events int DEFAULT 20)
RETURNS SETOF @extschema@.outbox_event
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cfg record;
    token bigint;
    -- Wall clock, not transaction start: a claim inside a long transaction must not stamp an old lease.
    stamp timestamptz := clock_timestamp();
    lease interval;
    skip_dead boolean;
    key_rows tid[];
    key_topics text[];
    key_names text[];
    key_due timestamptz[];
    share int;
BEGIN
    PERFORM @extschema@.outbox_check_isolation('outbox_claim');
    PERFORM @extschema@.outbox_check_owner('outbox_claim', owner);
    SELECT * INTO cfg FROM @extschema@.outbox_config();
    IF max_events IS NULL OR max_events < 1 OR max_events > cfg.max_claim THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('outbox_claim: max_events must be between 1 and %s (outbox.max_claim)', cfg.max_claim),
            DETAIL = format('max_events = %s', coalesce(max_events::text, 'NULL'));
    END IF;
    token := nextval('@extschema@.outbox_claim_token_seq');
    lease := make_interval(secs => cfg.lease_ms / 1000.0);
    -- missing_ok: the SQL-only build has no registered setting (its outbox_config() checks the value).
    skip_dead := lower(coalesce(current_setting('outbox.head_of_line', true), '')) = 'skip';

    -- Ordered keys due for a look, locked until this call's transaction ends: one caller at a
    -- time decides a key's run. SKIP LOCKED: concurrent claimers split the keys. At most 1,000
    -- keys, as an idle one costs an advisory lock below.
    SELECT array_agg(d.ctid ORDER BY d.due_at), array_agg(d.topic ORDER BY d.due_at),
           array_agg(d.event_key ORDER BY d.due_at), array_agg(d.due_at ORDER BY d.due_at)
      INTO key_rows, key_topics, key_names, key_due
      FROM (SELECT k.ctid, k.topic, k.event_key, k.due_at FROM @extschema@.outbox_key k
             WHERE k.due_at <= stamp
             ORDER BY k.due_at
             LIMIT least(max_events, 1000)
             FOR UPDATE SKIP LOCKED) d;
    -- Each key may fill an equal share of the batch (a single hot key: all of it).
    share := ceil(max_events::numeric / greatest(coalesce(cardinality(key_topics), 0), 1));

    -- The one statement that decides ownership. A key's run is the prefix of its unfinished
    -- events (in commit = id order, from its head) that are WAIT and due: nothing after a held,
    -- backing-off or dead event. Unordered events are claimed as before, SKIP LOCKED. The batch
    -- is cut by due time with a key's run ranked as one block, so a cut keeps a prefix.
    RETURN QUERY
    WITH keys AS (
        SELECT t.row_id, t.topic, t.event_key, t.due_at, t.rank
          FROM unnest(key_rows, key_topics, key_names, key_due)
               WITH ORDINALITY AS t(row_id, topic, event_key, due_at, rank)
    ), pending AS MATERIALIZED (
        SELECT k.rank, k.due_at AS key_due, p.id, p.status, p.next_retry_time, p.claimed_at, p.pos,
               bool_and(p.status = 'WAIT' AND p.next_retry_time <= stamp)
                   OVER (PARTITION BY k.rank ORDER BY p.pos) AS runnable
          FROM keys k
          CROSS JOIN LATERAL (
              SELECT e.id, e.status, e.next_retry_time, e.claimed_at,
                     row_number() OVER (ORDER BY e.id) AS pos
                FROM @extschema@.outbox_event e
               WHERE e.topic = k.topic AND e.event_key = k.event_key
                 AND e.ordered AND e.status <> 'SUCCESS'
                 AND NOT (e.status = 'FAIL' AND (skip_dead OR e.skipped_at IS NOT NULL))
               ORDER BY e.id
               LIMIT share
          ) p
    ), unordered AS MATERIALIZED (
        SELECT c.id, c.next_retry_time
          FROM @extschema@.outbox_event c
         WHERE c.status = 'WAIT' AND NOT c.ordered AND c.next_retry_time <= stamp
         ORDER BY c.next_retry_time, c.id
         LIMIT max_events
         FOR UPDATE SKIP LOCKED
    ), chosen AS MATERIALIZED (
        SELECT x.id FROM (
            SELECT p.id, p.key_due AS due, p.rank AS grp, p.pos FROM pending p WHERE p.runnable
            UNION ALL
            SELECT u.id, u.next_retry_time, 0, 1 FROM unordered u
        ) x
        ORDER BY x.due, x.grp, x.pos
        LIMIT max_events
    ), claimed AS (
        UPDATE @extschema@.outbox_event e
           SET status = 'SENDING', claim_owner = owner, claim_token = token,
               claimed_at = stamp, updated_at = stamp
         WHERE e.id = ANY (ARRAY(SELECT chosen.id FROM chosen)) AND e.status = 'WAIT'
        RETURNING e.*
    ), heads AS (
        -- Per visited key: whether this call claims some of it, and its head's state.
        SELECT p.rank, bool_or(c.id IS NOT NULL) AS holding,
               min(p.status) FILTER (WHERE p.pos = 1) AS status,
               min(p.next_retry_time) FILTER (WHERE p.pos = 1) AS next_retry_time,
               min(p.claimed_at) FILTER (WHERE p.pos = 1) AS claimed_at
          FROM pending p LEFT JOIN chosen c ON c.id = p.id
         GROUP BY p.rank
    ), verdict AS (
        -- When each visited key needs a look next: after its run (the lease, unless settled
        -- sooner), at its head's backoff, never while a dead head blocks it, or it looks idle.
        SELECT k.row_id,
               CASE WHEN h.holding THEN stamp + lease
                    WHEN h.rank IS NULL THEN '-infinity'::timestamptz
                    WHEN h.status = 'WAIT' AND h.next_retry_time <= stamp THEN k.due_at
                    WHEN h.status = 'WAIT' THEN h.next_retry_time
                    WHEN h.status = 'SENDING' THEN greatest(h.claimed_at + lease, stamp + interval '1 second')
                    ELSE 'infinity'::timestamptz
               END AS next_due
          FROM keys k LEFT JOIN heads h ON h.rank = k.rank
    ), looked AS (
        -- The key rows by their tuple ids: locked above, so they cannot have moved.
        UPDATE @extschema@.outbox_key k SET due_at = v.next_due
          FROM verdict v
         WHERE k.ctid = ANY (key_rows) AND k.ctid = v.row_id AND k.due_at <> v.next_due
    )
    -- UPDATE ... RETURNING has no order: give the relay its rows in publish (= commit) order.
    SELECT * FROM claimed c ORDER BY c.id;

    -- Keys that looked idle are deleted, unless a producer is enqueuing for one right now. The
    -- advisory lock is the producers' own: once it is held, the next statement's snapshot sees
    -- every event they committed, and none can add one before this transaction ends.
    SELECT array_agg(k.topic), array_agg(k.event_key) INTO key_topics, key_names
      FROM @extschema@.outbox_key k
     WHERE k.due_at = '-infinity'
       AND (k.topic, k.event_key) IN (SELECT * FROM unnest(key_topics, key_names))
       AND pg_try_advisory_xact_lock(@extschema@.outbox_key_lock_id(k.topic, k.event_key));
    IF key_topics IS NOT NULL THEN
        DELETE FROM @extschema@.outbox_key k
         USING unnest(key_topics, key_names) AS t(topic, event_key)
         WHERE k.topic = t.topic AND k.event_key = t.event_key AND k.due_at = '-infinity'
           AND NOT EXISTS (
               SELECT 1 FROM @extschema@.outbox_event e
                WHERE e.topic = k.topic AND e.event_key = k.event_key
                  AND e.ordered AND e.status <> 'SUCCESS'
                  AND NOT (e.status = 'FAIL' AND (skip_dead OR e.skipped_at IS NOT NULL)));
    END IF;
END
$$;

-- Grants carried over: bulk enqueue to whoever may enqueue, the wake-up to whoever may claim.
DO $$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT a.grantee::pg_catalog.regrole AS grantee
          FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
         WHERE p.oid = '@extschema@.outbox_enqueue(text, jsonb, text, text, jsonb, timestamptz)'::pg_catalog.regprocedure
           AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION @extschema@.outbox_enqueue_many(text, jsonb[], text[], text[], jsonb[], timestamptz) TO %s', g.grantee);
    END LOOP;
    FOR g IN
        SELECT a.grantee::pg_catalog.regrole AS grantee
          FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
         WHERE p.oid = '@extschema@.outbox_claim(text, int)'::pg_catalog.regprocedure
           AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION @extschema@.outbox_wait(interval) TO %s', g.grantee);
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION @extschema@.outbox_wake_mode() TO %s', g.grantee);
    END LOOP;
END
$$;
