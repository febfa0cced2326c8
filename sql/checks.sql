-- The SQL API, one file per concern in outbox-ext/src/lib.rs's order. Its functions are SECURITY
-- DEFINER with search_path pinned to pg_catalog, pg_temp, every object named with its schema, and
-- the helpers they call run under that path: callers need only EXECUTE, and nothing can redirect.

-- Argument checks shared by the relay-side calls. Raises 22023 naming the function and argument.
CREATE FUNCTION @extschema@.outbox_check_owner(fn text, owner text) RETURNS void
LANGUAGE plpgsql STABLE
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
AS $$
BEGIN
    IF ids IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: ids must be an array of event ids, not NULL', fn);
    END IF;
END
$$;

-- A count argument (a claim's max_events, a listing's max_rows): between 1 and `most`, the bound
-- named by `setting` when a setting gives it.
CREATE FUNCTION @extschema@.outbox_check_count(fn text, arg text, n int, most int, setting text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF n IS NULL OR n < 1 OR n > most THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: %s must be between 1 and %s%s', fn, arg, most, coalesce(' (' || setting || ')', '')),
            DETAIL = format('%s = %s', arg, coalesce(n::text, 'NULL'));
    END IF;
END
$$;

-- Calls that lock event rows need READ COMMITTED: under REPEATABLE READ or SERIALIZABLE a row
-- that another relay changed after the snapshot fails the whole call with 40001. Refuse up front
-- with one clear error instead of failing now and then under load.
CREATE FUNCTION @extschema@.outbox_check_isolation(fn text) RETURNS void
LANGUAGE plpgsql STABLE
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
