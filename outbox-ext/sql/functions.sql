-- SQL API of the outbox (CONTRACT.md section 2). Every function is SECURITY DEFINER with a pinned
-- search_path and schema-qualified names, so callers need only EXECUTE on it (section 4) and their
-- search_path cannot redirect anything. Every state change is ONE guarded UPDATE/DELETE: the
-- WHERE clause re-checks state, owner and fencing token, so a late or racing call is a no-op.

-- Argument checks shared by the relay-side calls. Raises 22023 naming the function and argument.
CREATE FUNCTION @extschema@.outbox_check_owner(fn text, owner text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
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
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF ids IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: ids must be an array of event ids, not NULL', fn);
    END IF;
END
$$;

-- The arguments that name a held claim (ack, nack, renew): owner, token and ids.
CREATE FUNCTION @extschema@.outbox_check_claim_args(fn text, owner text, claim_token bigint, ids bigint[])
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
BEGIN
    PERFORM @extschema@.outbox_check_owner(fn, owner);
    IF claim_token IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: claim_token must be the token returned by outbox_claim, not NULL', fn);
    END IF;
    PERFORM @extschema@.outbox_check_ids(fn, ids);
END
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
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
DECLARE
    header record;
    payload_bytes int;
    max_bytes int;
    new_id bigint;
BEGIN
    IF topic IS NULL OR topic = '' OR length(topic) > 249 OR topic !~ '^[A-Za-z0-9._-]+$'
       OR topic IN ('.', '..') THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_enqueue: topic must be 1 to 249 characters from [A-Za-z0-9._-] (not "." or "..")',
            DETAIL = format('topic = %L', left(topic, 80));
    END IF;
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
            IF header.key IN ('event_id', 'event_type', 'event_key') THEN
                RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
                    MESSAGE = format('outbox_enqueue: header %L is set by the relay and cannot be given in headers', header.key);
            END IF;
        END LOOP;
    END IF;
    -- Settings through scalar calls, not outbox_config(): this is the producer's hot path.
    payload_bytes := octet_length(payload::text);
    max_bytes := @extschema@.outbox_max_payload_bytes();
    IF payload_bytes > max_bytes THEN
        RAISE EXCEPTION USING ERRCODE = 'program_limit_exceeded',
            MESSAGE = format('outbox_enqueue: payload is %s bytes, outbox.max_payload_bytes allows at most %s',
                             payload_bytes, max_bytes);
    END IF;

    INSERT INTO @extschema@.outbox_event
        (topic, event_key, event_type, payload, headers, status, next_retry_time)
    VALUES
        (topic, key, event_type, payload, headers, 'WAIT', greatest(now(), deliver_at))
    RETURNING id INTO new_id;

    -- PostgreSQL folds identical notifications of one transaction into one, delivered at commit
    -- and dropped on rollback: one wake-up per transaction however many rows it enqueued.
    IF @extschema@.outbox_notify_enabled() THEN
        PERFORM pg_notify('outbox', '');
    END IF;
    RETURN new_id;
END
$$;

CREATE FUNCTION @extschema@.outbox_claim(owner text, max_events int DEFAULT 20)
RETURNS SETOF @extschema@.outbox_event
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
DECLARE
    cfg record;
    token bigint;
    -- Wall clock, not transaction start: a claim inside a long transaction must not stamp an old lease.
    stamp timestamptz := clock_timestamp();
BEGIN
    PERFORM @extschema@.outbox_check_owner('outbox_claim', owner);
    SELECT * INTO cfg FROM @extschema@.outbox_config();
    IF max_events IS NULL OR max_events < 1 OR max_events > cfg.max_claim THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('outbox_claim: max_events must be between 1 and %s (outbox.max_claim)', cfg.max_claim),
            DETAIL = format('max_events = %s', coalesce(max_events::text, 'NULL'));
    END IF;
    token := nextval('@extschema@.outbox_claim_token_seq');

    -- The MATERIALIZED CTE pins LIMIT to the row locks actually taken; SKIP LOCKED means
    -- concurrent claimers split the due rows instead of queueing behind each other.
    RETURN QUERY
    WITH due AS MATERIALIZED (
        SELECT c.id
        FROM @extschema@.outbox_event c
        WHERE c.status = 'WAIT' AND c.next_retry_time <= stamp
        ORDER BY c.next_retry_time, c.id
        LIMIT max_events
        FOR UPDATE SKIP LOCKED
    )
    UPDATE @extschema@.outbox_event e
       SET status = 'SENDING', claim_owner = owner, claim_token = token,
           claimed_at = stamp, updated_at = stamp
      FROM due
     WHERE e.id = due.id AND e.status = 'WAIT'
    RETURNING e.*;
END
$$;

CREATE FUNCTION @extschema@.outbox_ack(owner text, claim_token bigint, ids bigint[])
RETURNS int
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    done int;
BEGIN
    PERFORM @extschema@.outbox_check_claim_args('outbox_ack', owner, claim_token, ids);
    UPDATE @extschema@.outbox_event e
       SET status = 'SUCCESS', updated_at = clock_timestamp()
     WHERE e.id = ANY (ids) AND e.status = 'SENDING'
       AND e.claim_owner = owner AND e.claim_token = claim_token;
    GET DIAGNOSTICS done = ROW_COUNT;
    RETURN done;
END
$$;

CREATE FUNCTION @extschema@.outbox_nack(owner text, claim_token bigint, ids bigint[], error text DEFAULT NULL)
RETURNS int
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    cfg record;
    stamp timestamptz := clock_timestamp();
    done int;
BEGIN
    PERFORM @extschema@.outbox_check_claim_args('outbox_nack', owner, claim_token, ids);
    SELECT * INTO cfg FROM @extschema@.outbox_config();
    -- Backoff after the n-th failure: min(n^2 * base, max) * (1 +/- jitter).
    UPDATE @extschema@.outbox_event e
       SET retry_count = e.retry_count + 1,
           status = CASE WHEN e.retry_count + 1 > cfg.max_retry
                         THEN 'FAIL' ELSE 'WAIT' END::@extschema@.outbox_status,
           next_retry_time = stamp + make_interval(secs =>
               least(power(e.retry_count + 1, 2) * cfg.backoff_base_ms, cfg.backoff_max_ms)
               * (1 + cfg.backoff_jitter * (2 * random() - 1)) / 1000.0),
           claim_owner = NULL, claim_token = NULL, claimed_at = NULL,
           last_error = error, updated_at = stamp
     WHERE e.id = ANY (ids) AND e.status = 'SENDING'
       AND e.claim_owner = owner AND e.claim_token = claim_token;
    GET DIAGNOSTICS done = ROW_COUNT;
    RETURN done;
END
$$;

CREATE FUNCTION @extschema@.outbox_renew(owner text, claim_token bigint, ids bigint[])
RETURNS int
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    stamp timestamptz := clock_timestamp();
    done int;
BEGIN
    PERFORM @extschema@.outbox_check_claim_args('outbox_renew', owner, claim_token, ids);
    UPDATE @extschema@.outbox_event e
       SET claimed_at = stamp, updated_at = stamp
     WHERE e.id = ANY (ids) AND e.status = 'SENDING'
       AND e.claim_owner = owner AND e.claim_token = claim_token;
    GET DIAGNOSTICS done = ROW_COUNT;
    RETURN done;
END
$$;

CREATE FUNCTION @extschema@.outbox_reclaim(lease interval DEFAULT NULL)
RETURNS int
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
DECLARE
    cfg record;
    stamp timestamptz := clock_timestamp();
    done int;
BEGIN
    SELECT * INTO cfg FROM @extschema@.outbox_config();
    lease := coalesce(lease, make_interval(secs => cfg.lease_ms / 1000.0));
    IF lease <= interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_reclaim: lease must be a positive interval',
            DETAIL = format('lease = %s', lease);
    END IF;
    -- Guarded by status and claimed_at in the same statement: a row acked, nacked or renewed
    -- while this runs no longer matches and is left alone. A reclaim counts as a failed attempt,
    -- so a poison event that kills its relay every time still ends as a dead letter.
    UPDATE @extschema@.outbox_event e
       SET retry_count = e.retry_count + 1,
           status = CASE WHEN e.retry_count + 1 > cfg.max_retry
                         THEN 'FAIL' ELSE 'WAIT' END::@extschema@.outbox_status,
           next_retry_time = stamp,
           last_error = format('lease expired: claimed by %s at %s, not settled within %s',
                               e.claim_owner, e.claimed_at, lease),
           claim_owner = NULL, claim_token = NULL, claimed_at = NULL, updated_at = stamp
     WHERE e.status = 'SENDING' AND e.claimed_at < stamp - lease;
    GET DIAGNOSTICS done = ROW_COUNT;
    IF done > 0 AND cfg.notify THEN
        PERFORM pg_notify('outbox', '');
    END IF;
    RETURN done;
END
$$;

CREATE FUNCTION @extschema@.outbox_requeue(ids bigint[])
RETURNS int
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
DECLARE
    cfg record;
    stamp timestamptz := clock_timestamp();
    done int;
BEGIN
    PERFORM @extschema@.outbox_check_ids('outbox_requeue', ids);
    SELECT * INTO cfg FROM @extschema@.outbox_config();
    -- last_error is kept: it is the operator's record of why the event had failed.
    UPDATE @extschema@.outbox_event e
       SET status = 'WAIT', retry_count = 0, next_retry_time = stamp, updated_at = stamp
     WHERE e.id = ANY (ids) AND e.status = 'FAIL';
    GET DIAGNOSTICS done = ROW_COUNT;
    IF done > 0 AND cfg.notify THEN
        PERFORM pg_notify('outbox', '');
    END IF;
    RETURN done;
END
$$;

CREATE FUNCTION @extschema@.outbox_purge(older_than interval DEFAULT '7 days', max_rows int DEFAULT 10000)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
DECLARE
    done bigint;
BEGIN
    IF older_than IS NULL OR older_than < interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_purge: older_than must be an interval of zero or more',
            DETAIL = format('older_than = %s', coalesce(older_than::text, 'NULL'));
    END IF;
    IF max_rows IS NULL OR max_rows < 1 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_purge: max_rows must be at least 1',
            DETAIL = format('max_rows = %s', coalesce(max_rows::text, 'NULL'));
    END IF;
    -- Only SUCCESS rows, re-checked in the DELETE itself; FAIL rows wait for an operator.
    DELETE FROM @extschema@.outbox_event e
     WHERE e.id IN (SELECT s.id FROM @extschema@.outbox_event s
                     WHERE s.status = 'SUCCESS' AND s.updated_at < now() - older_than
                     LIMIT max_rows)
       AND e.status = 'SUCCESS';
    GET DIAGNOSTICS done = ROW_COUNT;
    RETURN done;
END
$$;

CREATE FUNCTION @extschema@.outbox_dead_letters(max_rows int DEFAULT 100, after_id bigint DEFAULT 0)
RETURNS SETOF @extschema@.outbox_event
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
BEGIN
    IF max_rows IS NULL OR max_rows < 1 OR max_rows > 100000 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_dead_letters: max_rows must be between 1 and 100000',
            DETAIL = format('max_rows = %s', coalesce(max_rows::text, 'NULL'));
    END IF;
    RETURN QUERY
    SELECT * FROM @extschema@.outbox_event e
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
    OUT oldest_lease_age interval
)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, @extschema@, pg_temp
AS $$
DECLARE
    stamp timestamptz := clock_timestamp();
    est real;
BEGIN
    -- Loads the library (and so the outbox.* settings) for relays that read them after this call.
    PERFORM @extschema@.outbox_config();
    -- Every count below reads a partial index whose size follows the backlog, not the history.
    SELECT count(*) FILTER (WHERE e.next_retry_time <= stamp),
           count(*) FILTER (WHERE e.next_retry_time > stamp),
           stamp - min(e.next_retry_time) FILTER (WHERE e.next_retry_time <= stamp)
      INTO due_wait, delayed_wait, oldest_due_age
      FROM @extschema@.outbox_event e WHERE e.status = 'WAIT';
    SELECT count(*), stamp - min(e.claimed_at)
      INTO sending, oldest_lease_age
      FROM @extschema@.outbox_event e WHERE e.status = 'SENDING';
    SELECT count(*) INTO failed FROM @extschema@.outbox_event e WHERE e.status = 'FAIL';
    -- SUCCESS rows are the history: count them exactly while the table is small (< 8 MB),
    -- estimate from the planner's statistics beyond that.
    SELECT c.reltuples INTO est
      FROM pg_class c WHERE c.oid = '@extschema@.outbox_event'::regclass;
    IF pg_relation_size('@extschema@.outbox_event'::regclass) < 8 * 1024 * 1024 OR est < 0 THEN
        SELECT count(*) INTO succeeded FROM @extschema@.outbox_event e WHERE e.status = 'SUCCESS';
    ELSE
        succeeded := greatest(est::bigint - due_wait - delayed_wait - sending - failed, 0);
    END IF;
END
$$;
