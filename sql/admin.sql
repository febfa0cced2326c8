-- For operators: dead letters, blocked keys, purge, stats.

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
        SELECT d.id FROM @extschema@.outbox_scheduled d
         WHERE d.id = ANY (ids) AND d.status = 'FAIL'
         ORDER BY d.id
         FOR UPDATE
    ), revived AS (
        UPDATE @extschema@.outbox_scheduled e
           SET status = 'WAIT', retry_count = 0, next_retry_time = stamp, skipped_at = NULL,
               updated_at = stamp
         WHERE e.id = ANY (ARRAY(SELECT dead.id FROM dead)) AND e.status = 'FAIL'
        RETURNING e.topic, e.event_key, e.ordered
    ), woken AS (
        -- A blocked key resumes with its requeued head; under the skip policy its row may be gone.
        INSERT INTO @extschema@.outbox_key AS k (topic, event_key, state, due_at)
        SELECT DISTINCT r.topic, r.event_key, 'waiting'::@extschema@.outbox_key_state, stamp
          FROM revived r WHERE r.ordered
         ORDER BY 1, 2
        ON CONFLICT (topic, event_key) DO UPDATE SET state = 'waiting', due_at = least(k.due_at, excluded.due_at)
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
    PERFORM @extschema@.outbox_check_count('outbox_blocked_keys', 'max_rows', max_rows, 100000);
    RETURN QUERY
    SELECT k.topic, k.event_key, h.id, h.updated_at, h.last_error,
           (SELECT count(*) FROM @extschema@.outbox_scheduled w
             WHERE w.topic = k.topic AND w.event_key = k.event_key AND w.ordered
               AND w.status <> 'SUCCESS' AND w.status = 'WAIT' AND w.id > h.id)
      FROM @extschema@.outbox_key k
      CROSS JOIN LATERAL (
          SELECT e.id, e.updated_at, e.last_error FROM @extschema@.outbox_scheduled e
           WHERE e.topic = k.topic AND e.event_key = k.event_key AND e.ordered
             AND e.status <> 'SUCCESS'
           ORDER BY e.id
           LIMIT 1
      ) h
     WHERE k.state = 'blocked'
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
    topics text[];
    event_keys text[];
BEGIN
    PERFORM @extschema@.outbox_check_isolation('outbox_skip');
    PERFORM @extschema@.outbox_check_ids('outbox_skip', ids);
    WITH dead AS MATERIALIZED (
        SELECT d.id FROM @extschema@.outbox_scheduled d
         WHERE d.id = ANY (ids) AND d.status = 'FAIL' AND d.skipped_at IS NULL
         ORDER BY d.id
         FOR UPDATE
    ), settled AS (
        UPDATE @extschema@.outbox_scheduled e SET skipped_at = stamp, updated_at = stamp
         WHERE e.id = ANY (ARRAY(SELECT dead.id FROM dead)) AND e.status = 'FAIL'
        RETURNING e.topic, e.event_key, e.ordered
    )
    SELECT count(*), array_agg(d.topic) FILTER (WHERE d.ordered), array_agg(d.event_key) FILTER (WHERE d.ordered)
      INTO done, topics, event_keys FROM settled d;
    PERFORM @extschema@.outbox_keys_wake(topics, event_keys, stamp);
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
    -- SUCCESS rows only (re-checked in the DELETE), oldest first by the partial index, so the cost
    -- follows the rows deleted. The DELETE locks them itself, in id order through the primary key
    -- (status::text: not by the age index); only another purge locks a SUCCESS row.
    WITH old AS MATERIALIZED (
        SELECT s.id FROM @extschema@.outbox_scheduled s
         WHERE s.status = 'SUCCESS' AND s.updated_at < now() - older_than
         ORDER BY s.updated_at
         LIMIT max_rows
    )
    , gone AS (
        DELETE FROM @extschema@.outbox_scheduled e
         WHERE e.id = ANY (ARRAY(SELECT old.id FROM old)) AND e.status::text = 'SUCCESS'
        RETURNING e.id
    ), originals AS (
        -- A stream event's first row goes with its scheduled copy (a retry, a busy key's event).
        DELETE FROM @extschema@.outbox_stream s
         WHERE s.id = ANY (ARRAY(SELECT g.id FROM gone g))
        RETURNING s.id
    )
    SELECT count(*) INTO done FROM gone;
    -- Stream rows: handed out, held by no claim (a retried one's scheduled copy stands for it) and
    -- older than the cutoff. Among the oldest max_rows ids only, so a purge never walks a backlog
    -- to find nothing: ids follow time closely enough for retention.
    IF done < max_rows THEN
        WITH c AS (
            SELECT * FROM @extschema@.outbox_cursor()
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
               AND NOT EXISTS (SELECT 1 FROM @extschema@.outbox_scheduled t WHERE t.id = h.id)
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
    PERFORM @extschema@.outbox_check_count('outbox_dead_letters', 'max_rows', max_rows, 100000);
    RETURN QUERY
    SELECT e.id, e.topic, e.event_key, e.event_type, e.payload, e.headers, e.status, e.retry_count,
           e.next_retry_time, e.claim_owner, e.claim_token, e.claimed_at, e.last_error, e.created_at,
           e.updated_at, e.event_id, e.ordered, e.skipped_at
      FROM @extschema@.outbox_scheduled e
     WHERE e.status = 'FAIL' AND e.id > coalesce(after_id, 0)
     ORDER BY e.id
     LIMIT max_rows;
END
$$;

-- Stream events past the cursor (committed ones: a plain read sees no other), read as
-- outbox_stream_take reads them, so the cost follows the backlog.
CREATE FUNCTION @extschema@.outbox_stream_waiting(OUT waiting bigint, OUT oldest timestamptz)
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    SELECT count(*), min(w.created_at) INTO waiting, oldest
      FROM @extschema@.outbox_cursor() c
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
END
$$;

-- SUCCESS rows are the history: counted exactly while the tables are small, else estimated from
-- the planner's statistics (reltuples) less the `unfinished` rows.
CREATE FUNCTION @extschema@.outbox_succeeded(unfinished bigint) RETURNS bigint
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    -- Below this size (both tables together, or one table) a count is cheap.
    small constant bigint := 8 * 1024 * 1024;
BEGIN
    IF pg_relation_size('@extschema@.outbox_scheduled'::regclass)
       + pg_relation_size('@extschema@.outbox_stream'::regclass) < small THEN
        RETURN (SELECT count(*) FROM @extschema@.outbox_event e WHERE e.status = 'SUCCESS');
    END IF;
    -- A table never vacuumed nor analyzed has no estimate (-1): count its rows while it is small,
    -- else take it as empty until autovacuum has seen it (an exact count would read the whole
    -- stream's history).
    RETURN greatest((SELECT sum(CASE WHEN c.reltuples >= 0 THEN c.reltuples::bigint
                                     WHEN pg_relation_size(c.oid) >= small THEN 0
                                     WHEN c.oid = '@extschema@.outbox_scheduled'::regclass
                                     THEN (SELECT count(*) FROM @extschema@.outbox_scheduled)
                                     ELSE (SELECT count(*) FROM @extschema@.outbox_stream) END)
                       FROM pg_class c
                      WHERE c.oid IN ('@extschema@.outbox_scheduled'::regclass,
                                      '@extschema@.outbox_stream'::regclass)) - unfinished, 0);
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
      FROM (SELECT e.next_retry_time FROM @extschema@.outbox_scheduled e
             WHERE e.status = 'WAIT' AND NOT e.ordered
            UNION ALL
            SELECT e.next_retry_time FROM @extschema@.outbox_scheduled e
             WHERE e.ordered AND e.status <> 'SUCCESS' AND e.status = 'WAIT') w;
    SELECT w.waiting, w.oldest INTO stream_wait, stream_oldest FROM @extschema@.outbox_stream_waiting() w;
    due_wait := due_wait + stream_wait;
    oldest_due_age := CASE WHEN stream_oldest IS NULL THEN oldest_due_age
                           ELSE greatest(oldest_due_age, stamp - stream_oldest) END;
    SELECT count(*), stamp - min(e.claimed_at)
      INTO sending, oldest_lease_age
      FROM @extschema@.outbox_scheduled e WHERE e.status = 'SENDING';
    SELECT sending + coalesce(sum(cardinality(b.pending)), 0),
           greatest(oldest_lease_age, stamp - min(b.claimed_at))
      INTO sending, oldest_lease_age
      FROM @extschema@.outbox_stream_batch b
     WHERE b.claim_token >= (SELECT c.batch_floor FROM @extschema@.outbox_cursor() c);
    SELECT count(*) INTO failed FROM @extschema@.outbox_scheduled e WHERE e.status = 'FAIL';
    -- Keys held back by a dead head, and since when that head has been dead.
    SELECT count(*), stamp - min(h.updated_at)
      INTO blocked_keys, oldest_blocked_age
      FROM @extschema@.outbox_key k
      CROSS JOIN LATERAL (
          SELECT e.updated_at FROM @extschema@.outbox_scheduled e
           WHERE e.topic = k.topic AND e.event_key = k.event_key AND e.ordered
             AND e.status <> 'SUCCESS'
           ORDER BY e.id
           LIMIT 1
      ) h
     WHERE k.state = 'blocked';
    succeeded := @extschema@.outbox_succeeded(due_wait + delayed_wait + sending + failed);
END
$$;
