-- outbox 0.5.0 -> 0.6.0 (docs/reference.md, "Life-cycle cost", "Per-key order" and "Upgrades").
-- * outbox_event gets fillfactor 50: a claim and an ack write the row's new version on its own
--   page, which the WAL logs as the changed bytes only (no payload copy) and without the extra
--   row-lock record of a version that moves to another page. Pages written before the update keep
--   their fill until their rows are purged; the table is not rewritten.
-- * ack, nack, renew and release lock their rows in the UPDATE itself (still in id order, through
--   the primary key) instead of a SELECT ... FOR UPDATE first, and purge in its DELETE instead of
--   FOR UPDATE SKIP LOCKED: one WAL record per row less.
-- * outbox_claim visits the due keys one after the other and takes each key's whole run until the
--   batch is full, locking a key row only when it reaches it, instead of an equal share of the
--   batch from up to 1,000 keys: far fewer key rows locked and written per claimed event.
-- Events in flight are untouched: same columns, same claims, same tokens.
\echo Use "ALTER EXTENSION outbox UPDATE TO '0.6.0'" to load this file. \quit

ALTER TABLE @extschema@.outbox_event SET (fillfactor = 50);

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
    -- What the visit of the due keys saw, one element per row: the key row (locked), its key
    -- and due time, and one of its unfinished events (NULL for a key with none).
    v_rows tid[];
    v_topics text[];
    v_names text[];
    v_due timestamptz[];
    v_ids bigint[];
    v_status @extschema@.outbox_status[];
    v_retry timestamptz[];
    v_claimed timestamptz[];
    v_pos bigint[];
    v_runnable boolean[];
    key_topics text[];
    key_names text[];
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

    -- The due ordered keys, oldest due first, each with its unfinished events from its head in
    -- commit (= id) order: as far as they are runnable (WAIT and due), and the head in any case.
    -- Rows are pulled until the batch is full, and a key row is locked (SKIP LOCKED: concurrent
    -- claimers split the keys) only when it is reached, so a claim visits as few keys as fill it:
    -- ten keys with runs of 50 rather than 500 keys with one event each, whose key rows would
    -- all be written twice (here and at the ack). At most 1,000 keys (an idle one costs an
    -- advisory lock below) and max_events rows per key (so a hot key's backlog is never read
    -- past what a batch can take).
    SELECT array_agg(c.row_id), array_agg(c.topic), array_agg(c.event_key), array_agg(c.due_at),
           array_agg(c.id), array_agg(c.status), array_agg(c.next_retry_time),
           array_agg(c.claimed_at), array_agg(c.pos), array_agg(c.runnable)
      INTO v_rows, v_topics, v_names, v_due, v_ids, v_status, v_retry, v_claimed, v_pos, v_runnable
      FROM (SELECT k.ctid AS row_id, k.topic, k.event_key, k.due_at, p.id, p.status,
                   p.next_retry_time, p.claimed_at, p.pos, coalesce(p.runnable, false) AS runnable
              FROM (SELECT d.ctid, d.topic, d.event_key, d.due_at FROM @extschema@.outbox_key d
                     WHERE d.due_at <= stamp
                     ORDER BY d.due_at
                     LIMIT least(max_events, 1000)
                     FOR UPDATE SKIP LOCKED) k
              LEFT JOIN LATERAL (
                  SELECT r.* FROM (
                      SELECT u.*, bool_and(u.status = 'WAIT' AND u.next_retry_time <= stamp)
                                      OVER (ORDER BY u.pos) AS runnable
                        FROM (SELECT e.id, e.status, e.next_retry_time, e.claimed_at,
                                     row_number() OVER (ORDER BY e.id) AS pos
                                FROM @extschema@.outbox_event e
                               WHERE e.topic = k.topic AND e.event_key = k.event_key
                                 AND e.ordered AND e.status <> 'SUCCESS'
                                 AND NOT (e.status = 'FAIL' AND (skip_dead OR e.skipped_at IS NOT NULL))
                               ORDER BY e.id
                               LIMIT max_events) u
                  ) r
                   WHERE r.runnable OR r.pos = 1
              ) p ON true
             LIMIT max_events) c;

    -- The one statement that decides ownership. A key's run is the prefix of its unfinished
    -- events (from its head) that are WAIT and due: nothing after a held, backing-off or dead
    -- event. Unordered events are claimed as before, SKIP LOCKED. The batch is cut by due time
    -- with a key's run ranked as one block, so a cut keeps a prefix.
    RETURN QUERY
    WITH pending AS MATERIALIZED (
        SELECT t.*
          FROM unnest(v_rows, v_topics, v_names, v_due, v_ids, v_status, v_retry, v_claimed, v_pos, v_runnable)
               AS t(row_id, topic, event_key, key_due, id, status, next_retry_time, claimed_at, pos, runnable)
    ), unordered AS MATERIALIZED (
        SELECT c.id, c.next_retry_time
          FROM @extschema@.outbox_event c
         WHERE c.status = 'WAIT' AND NOT c.ordered AND c.next_retry_time <= stamp
         ORDER BY c.next_retry_time, c.id
         LIMIT max_events
         FOR UPDATE SKIP LOCKED
    ), chosen AS MATERIALIZED (
        SELECT x.id FROM (
            SELECT p.id, p.key_due AS due, p.row_id AS grp, p.pos FROM pending p WHERE p.runnable
            UNION ALL
            SELECT u.id, u.next_retry_time, NULL::tid, 1 FROM unordered u
        ) x
        ORDER BY x.due, x.grp, x.pos
        LIMIT max_events
    ), claimed AS (
        UPDATE @extschema@.outbox_event e
           SET status = 'SENDING', claim_owner = owner, claim_token = token,
               claimed_at = stamp, updated_at = stamp
         WHERE e.id = ANY (ARRAY(SELECT chosen.id FROM chosen)) AND e.status = 'WAIT'
        RETURNING e.*
    ), verdict AS (
        -- When each visited key needs a look next: after its run (the lease, unless settled
        -- sooner), at its head's backoff, never while a dead head blocks it, or it looks idle.
        SELECT h.row_id,
               CASE WHEN h.holding THEN stamp + lease
                    WHEN h.status IS NULL THEN '-infinity'::timestamptz
                    WHEN h.status = 'WAIT' AND h.next_retry_time <= stamp THEN h.key_due
                    WHEN h.status = 'WAIT' THEN h.next_retry_time
                    WHEN h.status = 'SENDING' THEN greatest(h.claimed_at + lease, stamp + interval '1 second')
                    ELSE 'infinity'::timestamptz
               END AS next_due
          FROM (SELECT p.row_id, min(p.key_due) AS key_due, bool_or(c.id IS NOT NULL) AS holding,
                       min(p.status) FILTER (WHERE p.pos = 1) AS status,
                       min(p.next_retry_time) FILTER (WHERE p.pos = 1) AS next_retry_time,
                       min(p.claimed_at) FILTER (WHERE p.pos = 1) AS claimed_at
                  FROM pending p LEFT JOIN chosen c ON c.id = p.id
                 GROUP BY p.row_id) h
    ), looked AS (
        -- The key rows by their tuple ids: locked above, so they cannot have moved.
        UPDATE @extschema@.outbox_key k SET due_at = v.next_due
          FROM verdict v
         WHERE k.ctid = ANY (v_rows) AND k.ctid = v.row_id AND k.due_at <> v.next_due
    )
    -- UPDATE ... RETURNING has no order: give the relay its rows in publish (= commit) order.
    SELECT * FROM claimed c ORDER BY c.id;

    -- Keys that looked idle are deleted, unless a producer is enqueuing for one right now. The
    -- advisory lock is the producers' own: once it is held, the next statement's snapshot sees
    -- every event they committed, and none can add one before this transaction ends.
    SELECT array_agg(k.topic), array_agg(k.event_key) INTO key_topics, key_names
      FROM @extschema@.outbox_key k
     WHERE k.due_at = '-infinity'
       AND (k.topic, k.event_key) IN (SELECT t.topic, t.event_key
                                        FROM unnest(v_topics, v_names, v_ids) t(topic, event_key, id)
                                       WHERE t.id IS NULL)
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

CREATE OR REPLACE FUNCTION @extschema@.outbox_ack(owner text, claim_token bigint, ids bigint[])
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
        UPDATE @extschema@.outbox_event e
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
    RETURN done;
END
$$;

-- One failed attempt for the rows the caller still holds; returns each settled row with its new
-- state, so the caller knows which ones became dead letters without re-deriving the rule.
CREATE OR REPLACE FUNCTION @extschema@.outbox_nack_returning(owner text, claim_token bigint, ids bigint[], error text DEFAULT NULL)
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
BEGIN
    PERFORM @extschema@.outbox_check_claim_args('outbox_nack', owner, claim_token, ids);
    SELECT * INTO cfg FROM @extschema@.outbox_config();
    -- Backoff after the n-th failure: min(n^2 * base, max) * (1 +/- jitter).
    -- Row locks in id order, taken by the UPDATE itself (status::text: see outbox_ack).
    RETURN QUERY
    WITH settled AS (
        UPDATE @extschema@.outbox_event e
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
END
$$;

CREATE OR REPLACE FUNCTION @extschema@.outbox_renew(owner text, claim_token bigint, ids bigint[])
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
    UPDATE @extschema@.outbox_event e
       SET claimed_at = stamp, updated_at = stamp
     WHERE e.id = ANY (ids) AND e.status::text = 'SENDING'
       AND e.claim_owner = owner AND e.claim_token = claim_token;
    GET DIAGNOSTICS done = ROW_COUNT;
    RETURN done;
END
$$;

-- Hands held rows back WITHOUT counting a failed attempt: for failures that are not the event's
-- fault (broker unreachable, timeouts, not enough replicas). Fenced like nack; due after `delay`.
CREATE OR REPLACE FUNCTION @extschema@.outbox_release(owner text, claim_token bigint, ids bigint[],
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
BEGIN
    PERFORM @extschema@.outbox_check_claim_args('outbox_release', owner, claim_token, ids);
    IF delay IS NULL OR delay < interval '0' OR delay > interval '100 years' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_release: delay must be an interval from zero to 100 years',
            DETAIL = format('delay = %s', coalesce(delay::text, 'NULL'));
    END IF;
    -- Row locks in id order, taken by the UPDATE itself (status::text: see outbox_ack).
    WITH settled AS (
        UPDATE @extschema@.outbox_event e
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
    RETURN done;
END
$$;

CREATE OR REPLACE FUNCTION @extschema@.outbox_purge(older_than interval DEFAULT '7 days', max_rows int DEFAULT 10000)
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
        SELECT s.id FROM @extschema@.outbox_event s
         WHERE s.status = 'SUCCESS' AND s.updated_at < now() - older_than
         ORDER BY s.updated_at
         LIMIT max_rows
    )
    DELETE FROM @extschema@.outbox_event e
     WHERE e.id = ANY (ARRAY(SELECT old.id FROM old)) AND e.status::text = 'SUCCESS';
    GET DIAGNOSTICS done = ROW_COUNT;
    RETURN done;
END
$$;
