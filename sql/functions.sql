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
BEGIN
    -- Format and the operator's allow-list (outbox.allowed_topics), in Rust.
    PERFORM @extschema@.outbox_check_topic(topic);
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
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cfg record;
    token bigint;
    -- Wall clock, not transaction start: a claim inside a long transaction must not stamp an old lease.
    stamp timestamptz := clock_timestamp();
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

    -- The MATERIALIZED CTE pins LIMIT to the row locks actually taken; SKIP LOCKED means
    -- concurrent claimers split the due rows instead of queueing behind each other. The UPDATE
    -- finds the locked rows through an id array: one primary-key lookup per id in every plan,
    -- where a join to the CTE may hash the whole backlog (docs/reference.md, "Hardening").
    RETURN QUERY
    WITH due AS MATERIALIZED (
        SELECT c.id
        FROM @extschema@.outbox_event c
        WHERE c.status = 'WAIT' AND c.next_retry_time <= stamp
        ORDER BY c.next_retry_time, c.id
        LIMIT max_events
        FOR UPDATE SKIP LOCKED
    )
    , claimed AS (
        UPDATE @extschema@.outbox_event e
           SET status = 'SENDING', claim_owner = owner, claim_token = token,
               claimed_at = stamp, updated_at = stamp
         WHERE e.id = ANY (ARRAY(SELECT due.id FROM due)) AND e.status = 'WAIT'
        RETURNING e.*
    )
    -- UPDATE ... RETURNING has no order: give the relay its rows in due order.
    SELECT * FROM claimed c ORDER BY c.next_retry_time, c.id;
END
$$;

CREATE FUNCTION @extschema@.outbox_ack(owner text, claim_token bigint, ids bigint[])
RETURNS int
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    done int;
BEGIN
    PERFORM @extschema@.outbox_check_claim_args('outbox_ack', owner, claim_token, ids);
    -- Row locks in id order, the one order of every statement that may wait for a row lock
    -- (reclaim, purge and claim never wait: SKIP LOCKED). Two orders could deadlock.
    WITH held AS MATERIALIZED (
        SELECT h.id FROM @extschema@.outbox_event h
         WHERE h.id = ANY (ids) AND h.status = 'SENDING'
           AND h.claim_owner = owner AND h.claim_token = claim_token
         ORDER BY h.id
         FOR UPDATE
    )
    UPDATE @extschema@.outbox_event e
       SET status = 'SUCCESS', updated_at = clock_timestamp()
     WHERE e.id = ANY (ARRAY(SELECT held.id FROM held)) AND e.status = 'SENDING'
       AND e.claim_owner = owner AND e.claim_token = claim_token;
    GET DIAGNOSTICS done = ROW_COUNT;
    RETURN done;
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
    -- (reclaim, purge and claim never wait: SKIP LOCKED). Two orders could deadlock.
    RETURN QUERY
    WITH held AS MATERIALIZED (
        SELECT h.id FROM @extschema@.outbox_event h
         WHERE h.id = ANY (ids) AND h.status = 'SENDING'
           AND h.claim_owner = owner AND h.claim_token = claim_token
         ORDER BY h.id
         FOR UPDATE
    ), settled AS (
        UPDATE @extschema@.outbox_event e
           SET retry_count = e.retry_count + 1,
               status = @extschema@.outbox_status_after_failure(e.retry_count + 1, cfg.max_retry),
               next_retry_time = stamp + make_interval(secs =>
                   least(power(e.retry_count + 1, 2) * cfg.backoff_base_ms, cfg.backoff_max_ms)
                   * (1 + cfg.backoff_jitter * (2 * random() - 1)) / 1000.0),
               claim_owner = NULL, claim_token = NULL, claimed_at = NULL,
               -- A nack without a reason keeps the last one instead of erasing it.
               last_error = coalesce(error, e.last_error), updated_at = stamp
         WHERE e.id = ANY (ARRAY(SELECT held.id FROM held)) AND e.status = 'SENDING'
           AND e.claim_owner = owner AND e.claim_token = claim_token
        RETURNING e.id, e.topic, e.status, e.retry_count, e.next_retry_time
    )
    SELECT s.id, s.topic, s.status, s.retry_count, s.next_retry_time FROM settled s ORDER BY s.id;
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
AS $$
#variable_conflict use_variable
DECLARE
    stamp timestamptz := clock_timestamp();
    done int;
BEGIN
    PERFORM @extschema@.outbox_check_claim_args('outbox_renew', owner, claim_token, ids);
    -- Row locks in id order, the one order of every statement that may wait for a row lock
    -- (reclaim, purge and claim never wait: SKIP LOCKED). Two orders could deadlock.
    WITH held AS MATERIALIZED (
        SELECT h.id FROM @extschema@.outbox_event h
         WHERE h.id = ANY (ids) AND h.status = 'SENDING'
           AND h.claim_owner = owner AND h.claim_token = claim_token
         ORDER BY h.id
         FOR UPDATE
    )
    UPDATE @extschema@.outbox_event e
       SET claimed_at = stamp, updated_at = stamp
     WHERE e.id = ANY (ARRAY(SELECT held.id FROM held)) AND e.status = 'SENDING'
       AND e.claim_owner = owner AND e.claim_token = claim_token;
    GET DIAGNOSTICS done = ROW_COUNT;
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
    -- Row locks in id order, like ack, nack and renew.
    WITH held AS MATERIALIZED (
        SELECT h.id FROM @extschema@.outbox_event h
         WHERE h.id = ANY (ids) AND h.status = 'SENDING'
           AND h.claim_owner = owner AND h.claim_token = claim_token
         ORDER BY h.id
         FOR UPDATE
    )
    UPDATE @extschema@.outbox_event e
       SET status = 'WAIT', next_retry_time = stamp + delay,
           claim_owner = NULL, claim_token = NULL, claimed_at = NULL,
           last_error = coalesce(error, e.last_error), updated_at = stamp
     WHERE e.id = ANY (ARRAY(SELECT held.id FROM held)) AND e.status = 'SENDING'
       AND e.claim_owner = owner AND e.claim_token = claim_token;
    GET DIAGNOSTICS done = ROW_COUNT;
    RETURN done;
END
$$;

-- Expired claims back to WAIT (or FAIL): returns each reclaimed row with its new state and the
-- owner whose lease expired, so the caller can log and count the dead letters it made.
CREATE FUNCTION @extschema@.outbox_reclaim_returning(lease interval DEFAULT NULL)
RETURNS TABLE (id bigint, topic text, status @extschema@.outbox_status, retry_count int, expired_owner text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cfg record;
    stamp timestamptz := clock_timestamp();
    done int;
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
    RETURN QUERY
    WITH expired AS MATERIALIZED (
        SELECT x.id, x.claim_owner FROM @extschema@.outbox_event x
         WHERE x.status = 'SENDING' AND x.claimed_at < stamp - lease
         ORDER BY x.id
         FOR UPDATE SKIP LOCKED
    ), reclaimed AS (
        UPDATE @extschema@.outbox_event e
           SET retry_count = e.retry_count + 1,
               status = @extschema@.outbox_status_after_failure(e.retry_count + 1, cfg.max_retry),
               next_retry_time = stamp,
               last_error = format('lease expired: claimed by %s at %s, not settled within %s',
                                   e.claim_owner, e.claimed_at, lease),
               claim_owner = NULL, claim_token = NULL, claimed_at = NULL, updated_at = stamp
         WHERE e.id = ANY (ARRAY(SELECT expired.id FROM expired)) AND e.status = 'SENDING' AND e.claimed_at < stamp - lease
        RETURNING e.id, e.topic, e.status, e.retry_count
    )
    SELECT r.id, r.topic, r.status, r.retry_count, x.claim_owner
      FROM reclaimed r JOIN expired x ON x.id = r.id
     ORDER BY r.id;
    GET DIAGNOSTICS done = ROW_COUNT;
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
        SELECT d.id FROM @extschema@.outbox_event d
         WHERE d.id = ANY (ids) AND d.status = 'FAIL'
         ORDER BY d.id
         FOR UPDATE
    )
    UPDATE @extschema@.outbox_event e
       SET status = 'WAIT', retry_count = 0, next_retry_time = stamp, updated_at = stamp
     WHERE e.id = ANY (ARRAY(SELECT dead.id FROM dead)) AND e.status = 'FAIL';
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
SET search_path = pg_catalog, pg_temp
-- Planned per call: with the real cutoff the planner walks the SUCCESS index; a generic plan
-- (unknown cutoff) may scan the whole history instead (test: purge_reads_only_the_rows_it_deletes).
SET plan_cache_mode = force_custom_plan
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
    -- the rows deleted; SKIP LOCKED, so two purges split the work instead of waiting.
    WITH old AS MATERIALIZED (
        SELECT s.id FROM @extschema@.outbox_event s
         WHERE s.status = 'SUCCESS' AND s.updated_at < now() - older_than
         ORDER BY s.updated_at
         LIMIT max_rows
         FOR UPDATE SKIP LOCKED
    )
    DELETE FROM @extschema@.outbox_event e
     WHERE e.id = ANY (ARRAY(SELECT old.id FROM old)) AND e.status = 'SUCCESS';
    GET DIAGNOSTICS done = ROW_COUNT;
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
SET search_path = pg_catalog, pg_temp
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
