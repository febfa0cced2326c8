-- Settling a claim: ack, nack, renew, release; each touches only what (owner, token) still holds.
-- The relay's calls plan their statements once per session (force_generic_plan), as outbox_claim.

-- The retry rule, written once (nack and reclaim): after its n-th failed attempt an event is a
-- dead letter (FAIL) when n exceeds outbox.max_retry, else it waits for its next attempt.
CREATE FUNCTION @extschema@.outbox_status_after_failure(attempts int, max_retry int)
RETURNS @extschema@.outbox_status
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN attempts > max_retry THEN 'FAIL' ELSE 'WAIT' END::@extschema@.outbox_status
$$;

-- How long an event waits after its n-th failed attempt: min(n^2 * base, max) * (1 +/- jitter).
CREATE FUNCTION @extschema@.outbox_backoff(attempts int, base_ms bigint, max_ms bigint, jitter float8)
RETURNS interval
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT make_interval(secs => least(power(attempts, 2) * base_ms, max_ms)
                                 * (1 + jitter * (2 * random() - 1)) / 1000.0)
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
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_variable
DECLARE
    cfg record;
    stamp timestamptz := clock_timestamp();
    settled_ids bigint[];
    topics text[];
    event_keys text[];
    held bigint[];
BEGIN
    PERFORM @extschema@.outbox_check_claim_args('outbox_nack', owner, claim_token, ids);
    SELECT * INTO cfg FROM @extschema@.outbox_config();
    -- Row locks in id order, taken by the UPDATE itself (status::text: see outbox_ack_returning).
    WITH settled AS (
        UPDATE @extschema@.outbox_scheduled e
           SET retry_count = e.retry_count + 1,
               status = @extschema@.outbox_status_after_failure(e.retry_count + 1, cfg.max_retry),
               next_retry_time = stamp + @extschema@.outbox_backoff(e.retry_count + 1, cfg.backoff_base_ms,
                                                                    cfg.backoff_max_ms, cfg.backoff_jitter),
               claim_owner = NULL, claim_token = NULL, claimed_at = NULL,
               -- A nack without a reason keeps the last one instead of erasing it.
               last_error = coalesce(error, e.last_error), updated_at = stamp
         WHERE e.id = ANY (ids) AND e.status::text = 'SENDING'
           AND e.claim_owner = owner AND e.claim_token = claim_token
        RETURNING e.id, e.topic, e.event_key, e.ordered
    )
    SELECT array_agg(d.id), array_agg(d.topic) FILTER (WHERE d.ordered), array_agg(d.event_key) FILTER (WHERE d.ordered)
      INTO settled_ids, topics, event_keys FROM settled d;
    PERFORM @extschema@.outbox_keys_wake(topics, event_keys, stamp);
    RETURN QUERY
    SELECT e.id, e.topic, e.status, e.retry_count, e.next_retry_time FROM @extschema@.outbox_scheduled e
     WHERE e.id = ANY (settled_ids) ORDER BY e.id;
    -- Stream events of this claim fail their first attempt (one backoff for the batch).
    held := @extschema@.outbox_stream_settle(owner, claim_token, ids);
    RETURN QUERY
    SELECT * FROM @extschema@.outbox_stream_schedule(
        held, @extschema@.outbox_status_after_failure(1, cfg.max_retry), 1,
        stamp + @extschema@.outbox_backoff(1, cfg.backoff_base_ms, cfg.backoff_max_ms, cfg.backoff_jitter),
        error, stamp) m ORDER BY m.id;
    PERFORM @extschema@.outbox_keys_wait(held, stamp);
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
    -- Row locks in id order, taken by the UPDATE itself (status::text: see outbox_ack_returning).
    UPDATE @extschema@.outbox_scheduled e
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
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_variable
DECLARE
    stamp timestamptz := clock_timestamp();
    done int;
    topics text[];
    event_keys text[];
    held bigint[];
BEGIN
    PERFORM @extschema@.outbox_check_claim_args('outbox_release', owner, claim_token, ids);
    IF delay IS NULL OR delay < interval '0' OR delay > interval '100 years' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_release: delay must be an interval from zero to 100 years',
            DETAIL = format('delay = %s', coalesce(delay::text, 'NULL'));
    END IF;
    -- Row locks in id order, taken by the UPDATE itself (status::text: see outbox_ack_returning).
    WITH settled AS (
        UPDATE @extschema@.outbox_scheduled e
           SET status = 'WAIT', next_retry_time = stamp + delay,
               claim_owner = NULL, claim_token = NULL, claimed_at = NULL,
               last_error = coalesce(error, e.last_error), updated_at = stamp
         WHERE e.id = ANY (ids) AND e.status::text = 'SENDING'
           AND e.claim_owner = owner AND e.claim_token = claim_token
        RETURNING e.topic, e.event_key, e.ordered
    )
    SELECT count(*), array_agg(d.topic) FILTER (WHERE d.ordered), array_agg(d.event_key) FILTER (WHERE d.ordered)
      INTO done, topics, event_keys FROM settled d;
    PERFORM @extschema@.outbox_keys_wake(topics, event_keys, stamp);
    -- Stream events go back as scheduled copies (same id and event_id), due after the delay.
    held := @extschema@.outbox_stream_settle(owner, claim_token, ids);
    PERFORM @extschema@.outbox_stream_schedule(held, 'WAIT', 0, stamp + delay, error, stamp);
    PERFORM @extschema@.outbox_keys_wait(held, stamp);
    done := done + cardinality(held);
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
          FROM (SELECT t.claim_token AS token, t.id FROM @extschema@.outbox_scheduled t
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

-- SENDING -> SUCCESS for the rows the caller still holds; returns the ids it settled, so the caller
-- counts what the outbox confirmed (a retry after a lost reply, or after a reclaim, returns fewer).
CREATE FUNCTION @extschema@.outbox_ack_returning(owner text, claim_token bigint, ids bigint[])
RETURNS SETOF bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Only the primary key's index scan takes row locks in id order (see the body).
SET enable_seqscan = off
SET enable_bitmapscan = off
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_variable
DECLARE
    stamp timestamptz := clock_timestamp();
    settled_ids bigint[];
    topics text[];
    event_keys text[];
BEGIN
    PERFORM @extschema@.outbox_check_claim_args('outbox_ack', owner, claim_token, ids);
    -- Row locks in id order (docs/design.md, "Lock order"), taken by the UPDATE itself through the
    -- primary key: the SET clauses rule out other scans and status::text the lease index
    -- (sql_claim_plan checks it). A SELECT ... FOR UPDATE first would cost a WAL record per row.
    WITH settled AS (
        UPDATE @extschema@.outbox_scheduled e
           SET status = 'SUCCESS', updated_at = stamp
         WHERE e.id = ANY (ids) AND e.status::text = 'SENDING'
           AND e.claim_owner = owner AND e.claim_token = claim_token
        RETURNING e.id, e.topic, e.event_key, e.ordered
    )
    SELECT array_agg(d.id ORDER BY d.id), array_agg(d.topic) FILTER (WHERE d.ordered),
           array_agg(d.event_key) FILTER (WHERE d.ordered)
      INTO settled_ids, topics, event_keys FROM settled d;
    PERFORM @extschema@.outbox_keys_wake(topics, event_keys, stamp);
    RETURN QUERY SELECT unnest(settled_ids);
    -- Stream events of this claim: out of its batch, nothing else to write (they are SUCCESS).
    RETURN QUERY SELECT unnest(@extschema@.outbox_stream_settle(owner, claim_token, ids));
END
$$;

-- outbox_ack_returning, counted: how many of the ids were still held and settled. PL/pgSQL, not
-- SQL: a SQL function with SET clauses is planned again at every call (claim-and-ack loops).
CREATE FUNCTION @extschema@.outbox_ack(owner text, claim_token bigint, ids bigint[])
RETURNS int
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN (SELECT count(*)::int FROM @extschema@.outbox_ack_returning(owner, claim_token, ids));
END
$$;
