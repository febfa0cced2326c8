-- outbox 0.5.0 -> 0.6.0 (docs/reference.md, "Life-cycle cost" and "Upgrades").
-- * outbox_event gets fillfactor 50: a claim and an ack write the row's new version on its own
--   page, which the WAL logs as the changed bytes only (no payload copy) and without the extra
--   row-lock record of a version that moves to another page. Pages written before the update keep
--   their fill until their rows are purged; the table is not rewritten.
-- * ack, nack, renew and release lock their rows in the UPDATE itself (still in id order, through
--   the primary key) instead of a SELECT ... FOR UPDATE first: one WAL record per row less.
-- Events in flight are untouched: same columns, same claims, same tokens.
\echo Use "ALTER EXTENSION outbox UPDATE TO '0.6.0'" to load this file. \quit

ALTER TABLE @extschema@.outbox_event SET (fillfactor = 50);

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
    -- Row locks in id order, the one order of every statement that may wait for a row lock
    -- (reclaim, purge and claim never wait: SKIP LOCKED). Two orders could deadlock. The UPDATE
    -- takes them itself, by a primary-key scan that walks the sorted ids: the SET clauses rule
    -- out sequential and bitmap scans, and status::text keeps the planner off the lease index
    -- (claimed_at order), whose predicate it can no longer prove. sql_claim_plan checks it. A
    -- SELECT ... FOR UPDATE first would cost a second WAL record per row (docs/reference.md,
    -- "Life-cycle cost").
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
    -- Row locks in id order, the one order of every statement that may wait for a row lock
    -- (reclaim, purge and claim never wait: SKIP LOCKED). Two orders could deadlock. The UPDATE
    -- takes them itself, by a primary-key scan that walks the sorted ids: the SET clauses rule
    -- out sequential and bitmap scans, and status::text keeps the planner off the lease index
    -- (claimed_at order), whose predicate it can no longer prove. sql_claim_plan checks it. A
    -- SELECT ... FOR UPDATE first would cost a second WAL record per row (docs/reference.md,
    -- "Life-cycle cost").
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
    -- Row locks in id order, taken by the UPDATE itself (status::text: see ack).
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
