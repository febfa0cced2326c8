-- The SQL-only build's versions of what the native build writes in Rust (outbox-ext/src/guc.rs,
-- outbox-ext/src/producer.rs) or in C: same names, arguments, results and volatility, so
-- schema.sql, the API's files and privileges.sql run unchanged on top of them. scripts/sql-only puts
-- this file first in outbox--VERSION.sql. docs/sql-only.md lists what differs.
--
-- Settings. The native build registers the outbox.* settings, so PostgreSQL checks every SET. Here
-- they are placeholders: any SET succeeds, and a value is parsed and checked when a call reads it,
-- with the native build's SQLSTATE (22023) and a message naming the setting. A misspelt name
-- (outbox.max_retries) is not detected.
--
-- The producer guards (outbox.max_payload_bytes, outbox.allowed_topics, outbox.unordered_topics)
-- are SUSET in the native build: only superusers and roles granted SET on them may change them.
-- A placeholder is settable by anyone, so here a value counts only if it comes from a role that
-- may: the caller (its SET ROLE, else its login role) is a member of the role owning the outbox
-- (the installer), or the value is the database's (ALTER DATABASE ... SET, which only the
-- database owner may run). Anyone else may only narrow them: a lower outbox.max_payload_bytes, an
-- outbox.allowed_topics that applies on top of the database's; anything else raises 42501 at use.

-- The installed build and version: the SQL-only build has no pg_extension row, so the relay and
-- operators read this instead. Callable by everyone, like pg_extension.extversion: it reads nothing.
-- Each generated upgrade step replaces it.
CREATE FUNCTION @extschema@.outbox_sql_only_version() RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT '@VERSION@'::text $$;

-- UUID version 7 (RFC 9562): 48-bit Unix milliseconds, then random bits (version 4's, with the
-- version nibble changed from 4 to 7; the variant bits stay 10).
CREATE FUNCTION @extschema@.outbox_uuidv7() RETURNS uuid
LANGUAGE sql STRICT VOLATILE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),
        'hex')::uuid
$$;

-- The raw value of a setting as this session sees it; NULL when it was never set or was reset.
CREATE FUNCTION @extschema@.outbox_setting_raw(name text) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT nullif(current_setting(name, true), '') $$;

-- The value this database sets (ALTER DATABASE ... SET), NULL when none: only the database owner
-- and superusers can change it.
CREATE FUNCTION @extschema@.outbox_setting_database(name text) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT nullif(substr(c, length(name) + 2), '')
      FROM pg_db_role_setting s, unnest(s.setconfig) c
     WHERE s.setdatabase = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
       AND s.setrole = 0 AND starts_with(c, name || '=')
     LIMIT 1
$$;

-- Whether the caller may set the producer guards: its current role (SET ROLE; a SECURITY DEFINER
-- function does not change it), else its login role, is a member of the outbox's owner.
CREATE FUNCTION @extschema@.outbox_setting_trusted() RETURNS boolean
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- plpgsql: created before the table it names.
    RETURN pg_has_role(CASE WHEN current_setting('role') = 'none' THEN session_user::text
                            ELSE current_setting('role') END::name,
                       (SELECT c.relowner FROM pg_class c WHERE c.oid = '@extschema@.outbox_scheduled'::regclass),
                       'MEMBER');
END
$$;

-- 42501 for a producer guard changed by a role that may not (see the top of this file).
CREATE FUNCTION @extschema@.outbox_setting_denied(name text, value text, database_value text) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
        MESSAGE = format('permission denied to set parameter "%s"', name),
        DETAIL = format('%s = %L, the database sets %L; in the SQL-only build this role may not widen it.',
                        name, value, coalesce(database_value, '')),
        HINT = format('Set it with ALTER DATABASE ... SET %s, or as a member of the outbox''s owner.', name);
END
$$;

-- An integer setting like PostgreSQL's own: an integer or decimal number (rounded), optionally
-- followed by a unit (unit = 'ms': us, ms, s, min, h, d; unit = 'B': B, kB, MB, GB, TB), within
-- lo .. hi. value NULL: the default.
CREATE FUNCTION @extschema@.outbox_setting_int(name text, value text, dflt bigint, unit text, lo bigint, hi bigint)
RETURNS bigint
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    m text[];
    factor numeric;
    n numeric;
BEGIN
    IF value IS NULL THEN
        RETURN dflt;
    END IF;
    m := regexp_match(value, '^\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*$');
    factor := CASE
        WHEN m IS NULL THEN NULL
        WHEN m[2] = '' THEN 1
        WHEN unit = 'ms' THEN CASE m[2] WHEN 'us' THEN 0.001 WHEN 'ms' THEN 1 WHEN 's' THEN 1000
                                        WHEN 'min' THEN 60000 WHEN 'h' THEN 3600000 WHEN 'd' THEN 86400000 END
        WHEN unit = 'B' THEN CASE m[2] WHEN 'B' THEN 1 WHEN 'kB' THEN 1024 WHEN 'MB' THEN 1048576
                                       WHEN 'GB' THEN 1073741824 WHEN 'TB' THEN 1099511627776 END
    END;
    IF factor IS NULL OR length(m[1]) > 40 THEN
        PERFORM @extschema@.outbox_setting_error(
            format('invalid value for parameter "%s": "%s"', name, value),
            CASE unit WHEN 'ms' THEN 'Valid units for this parameter are "us", "ms", "s", "min", "h", and "d".'
                      WHEN 'B' THEN 'Valid units for this parameter are "B", "kB", "MB", "GB", and "TB".' END);
    END IF;
    n := round(m[1]::numeric * factor);
    IF n < lo OR n > hi THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s%s is outside the valid range for parameter "%s" (%s .. %s)',
                             n, CASE WHEN unit IS NULL THEN '' ELSE ' ' || unit END, name, lo, hi);
    END IF;
    RETURN n;
END
$$;

-- Raises 22023 with this message and hint.
CREATE FUNCTION @extschema@.outbox_setting_error(message text, hint text) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF hint IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = message;
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value', MESSAGE = message, HINT = hint;
END
$$;

CREATE FUNCTION @extschema@.outbox_setting_bool(name text, dflt boolean) RETURNS boolean
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v text := lower(btrim(@extschema@.outbox_setting_raw(name)));
BEGIN
    -- PostgreSQL's spellings: true/false, yes/no (unique prefixes), on/off, 1/0.
    IF v IS NULL THEN
        RETURN dflt;
    ELSIF v IN ('on', '1') OR (v <> '' AND (starts_with('true', v) OR starts_with('yes', v))) THEN
        RETURN true;
    ELSIF v IN ('of', 'off', '0') OR (v <> '' AND (starts_with('false', v) OR starts_with('no', v))) THEN
        RETURN false;
    END IF;
    PERFORM @extschema@.outbox_setting_error(format('parameter "%s" requires a Boolean value', name), NULL);
    RETURN NULL;
END
$$;

-- outbox.max_payload_bytes, a producer guard: the caller may only lower the database's value.
CREATE FUNCTION @extschema@.outbox_max_payload_bytes() RETURNS int
LANGUAGE plpgsql STRICT STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    name constant text := 'outbox.max_payload_bytes';
    raw text;
    db_raw text;
    v bigint;
BEGIN
    -- Never set in this session, its role or its database (the placeholder does not exist): the
    -- default, without looking at the catalog (the producer's hot path).
    IF current_setting(name, true) IS NULL THEN
        RETURN 1000000;
    END IF;
    raw := @extschema@.outbox_setting_raw(name);
    db_raw := @extschema@.outbox_setting_database(name);
    v := @extschema@.outbox_setting_int(name, coalesce(raw, db_raw), 1000000, 'B', 1, 2147483647);
    IF raw IS NOT NULL AND raw IS DISTINCT FROM db_raw
       AND v > @extschema@.outbox_setting_int(name, db_raw, 1000000, 'B', 1, 2147483647)
       AND NOT @extschema@.outbox_setting_trusted() THEN
        PERFORM @extschema@.outbox_setting_denied(name, raw, db_raw);
    END IF;
    RETURN v;
END
$$;

CREATE FUNCTION @extschema@.outbox_notify_enabled() RETURNS boolean
LANGUAGE sql STRICT STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT @extschema@.outbox_setting_bool('outbox.notify', false) $$;

-- The current settings in one typed row (the native build's outbox_config()), each checked.
CREATE FUNCTION @extschema@.outbox_config()
RETURNS TABLE (max_retry int, backoff_base_ms bigint, backoff_max_ms bigint, backoff_jitter double precision,
               lease_ms bigint, max_claim int, max_payload_bytes int, notify boolean)
LANGUAGE plpgsql STRICT STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    jitter text := @extschema@.outbox_setting_raw('outbox.backoff_jitter');
    head_of_line text := @extschema@.outbox_setting_raw('outbox.head_of_line');
BEGIN
    max_retry := @extschema@.outbox_setting_int('outbox.max_retry',
        @extschema@.outbox_setting_raw('outbox.max_retry'), 3, NULL, 0, 1000);
    backoff_base_ms := @extschema@.outbox_setting_int('outbox.backoff_base',
        @extschema@.outbox_setting_raw('outbox.backoff_base'), 5000, 'ms', 1, 2147483647);
    backoff_max_ms := @extschema@.outbox_setting_int('outbox.backoff_max',
        @extschema@.outbox_setting_raw('outbox.backoff_max'), 3600000, 'ms', 1, 2147483647);
    IF jitter IS NULL THEN
        backoff_jitter := 0;
    ELSIF jitter !~ '^\s*[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?\s*$' THEN
        PERFORM @extschema@.outbox_setting_error(
            format('invalid value for parameter "outbox.backoff_jitter": "%s"', jitter), NULL);
    ELSE
        backoff_jitter := btrim(jitter)::double precision;
        IF backoff_jitter < 0 OR backoff_jitter > 1 THEN
            PERFORM @extschema@.outbox_setting_error(
                format('%s is outside the valid range for parameter "outbox.backoff_jitter" (0 .. 1)', backoff_jitter), NULL);
        END IF;
    END IF;
    lease_ms := @extschema@.outbox_setting_int('outbox.lease',
        @extschema@.outbox_setting_raw('outbox.lease'), 600000, 'ms', 1, 2147483647);
    max_claim := @extschema@.outbox_setting_int('outbox.max_claim',
        @extschema@.outbox_setting_raw('outbox.max_claim'), 10000, NULL, 1, 1000000);
    max_payload_bytes := @extschema@.outbox_max_payload_bytes();
    notify := @extschema@.outbox_notify_enabled();
    -- Read by outbox_claim with current_setting (the native build registers it as an enum).
    IF head_of_line IS NOT NULL AND lower(head_of_line) NOT IN ('block', 'skip') THEN
        PERFORM @extschema@.outbox_setting_error(
            format('invalid value for parameter "outbox.head_of_line": "%s"', head_of_line),
            'Available values: block, skip.');
    END IF;
    RETURN NEXT;
END
$$;

-- Whether topic matches an entry of the comma-separated list (names or prefix* patterns; * alone
-- matches every topic): NULL for an empty list, 22023 naming a malformed entry (producer.rs).
CREATE FUNCTION @extschema@.outbox_topic_list_match(setting text, list text, topic text) RETURNS boolean
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    entry text;
    stem text;
    hit boolean;
BEGIN
    FOREACH entry IN ARRAY string_to_array(coalesce(list, ''), ',') LOOP
        entry := regexp_replace(entry, '^\s+|\s+$', '', 'g');
        CONTINUE WHEN entry = '';
        hit := coalesce(hit, false);
        stem := CASE WHEN right(entry, 1) = '*' THEN left(entry, -1) ELSE entry END;
        IF NOT ((right(entry, 1) = '*' AND stem = '')
                OR (stem ~ '^[A-Za-z0-9._-]{1,249}$' AND stem NOT IN ('.', '..'))) THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
                MESSAGE = format('%s: entry "%s" is neither a topic name nor a prefix* pattern', setting, entry),
                DETAIL = format('%s = ''%s''', setting, list);
        END IF;
        hit := hit OR CASE WHEN right(entry, 1) = '*' THEN starts_with(topic, stem) ELSE topic = stem END;
    END LOOP;
    RETURN hit;
END
$$;

-- Raises 22023 unless topic is a valid Kafka topic name allowed by outbox.allowed_topics.
CREATE FUNCTION @extschema@.outbox_check_topic(topic text) RETURNS void
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    name constant text := 'outbox.allowed_topics';
    raw text;
    db_raw text;
BEGIN
    IF topic IS NULL OR topic !~ '^[A-Za-z0-9._-]{1,249}$' OR topic IN ('.', '..') THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_enqueue: topic must be 1 to 249 characters from [A-Za-z0-9._-] (not "." or "..")',
            DETAIL = format('topic = %s', coalesce(quote_literal(left(topic, 80)), 'NULL'));
    END IF;
    -- Never set anywhere (no placeholder, so no database value either): any topic.
    IF current_setting(name, true) IS NULL THEN
        RETURN;
    END IF;
    raw := @extschema@.outbox_setting_raw(name);
    db_raw := @extschema@.outbox_setting_database(name);
    -- The session's list (or the database's), and the database's too unless the caller may set it.
    IF NOT coalesce(@extschema@.outbox_topic_list_match(name, coalesce(raw, db_raw), topic), true) THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('outbox_enqueue: topic "%s" is not in outbox.allowed_topics', topic),
            DETAIL = format('outbox.allowed_topics = ''%s''', coalesce(raw, db_raw, ''));
    END IF;
    IF raw IS NOT NULL AND raw IS DISTINCT FROM db_raw
       AND NOT coalesce(@extschema@.outbox_topic_list_match(name, db_raw, topic), true)
       AND NOT @extschema@.outbox_setting_trusted() THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('outbox_enqueue: topic "%s" is not in outbox.allowed_topics', topic),
            DETAIL = format('outbox.allowed_topics = ''%s'' (the database''s; this role may only narrow it)', coalesce(db_raw, ''));
    END IF;
END
$$;

-- Whether keyed events of topic keep their key's order: true unless outbox.unordered_topics names
-- it. Only a role that may set it may use another list than the database's (42501).
CREATE FUNCTION @extschema@.outbox_topic_ordered(topic text) RETURNS boolean
LANGUAGE plpgsql STRICT STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    name constant text := 'outbox.unordered_topics';
    raw text;
    db_raw text;
BEGIN
    -- Never set anywhere: every keyed event keeps its key's order.
    IF current_setting(name, true) IS NULL THEN
        RETURN true;
    END IF;
    raw := @extschema@.outbox_setting_raw(name);
    db_raw := @extschema@.outbox_setting_database(name);
    IF raw IS NOT NULL AND raw IS DISTINCT FROM db_raw AND NOT @extschema@.outbox_setting_trusted() THEN
        PERFORM @extschema@.outbox_setting_denied(name, raw, db_raw);
    END IF;
    RETURN NOT coalesce(@extschema@.outbox_topic_list_match(name, coalesce(raw, db_raw), topic), false);
END
$$;

-- The SQL half of outbox_enqueue in one call (wake.rs): the topic's checks, and whether the event
-- keeps its key's order. Nothing to note for the wake-up: this build has no shared memory, its
-- outbox_wait always polls.
CREATE FUNCTION @extschema@.outbox_enqueue_begin(topic text, key text) RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM @extschema@.outbox_check_topic(topic);
    RETURN key IS NOT NULL AND @extschema@.outbox_topic_ordered(topic);
END
$$;

-- Whether the session's client is still connected (client.rs): outbox_claim rolls back a claim
-- whose client died while it ran. SQL cannot look at the socket, so here it always says yes, and
-- such a claim waits out its lease (docs/sql-only.md).
CREATE FUNCTION @extschema@.outbox_client_connected() RETURNS boolean
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT true $$;

-- How outbox_wait is woken: always 'polling' here (the native build says 'commit' when preloaded).
CREATE FUNCTION @extschema@.outbox_wake_mode() RETURNS text
LANGUAGE sql STRICT STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 'polling'::text $$;

-- The engine of outbox_wait (claim.sql checks the arguments and the isolation level): true as
-- soon as work_due (a function returning whether a claim may find something) says so, false after
-- timeout_ms. Looks every outbox.wait_poll_interval (10 ms), each look with a fresh snapshot;
-- statement_timeout and pg_cancel_backend end the sleep between looks.
CREATE FUNCTION @extschema@.outbox_wait_for(timeout_ms bigint, work_due oid) RETURNS boolean
LANGUAGE plpgsql STRICT VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    deadline timestamptz := clock_timestamp() + make_interval(secs => greatest(timeout_ms, 0) / 1000.0);
    poll_s double precision := @extschema@.outbox_setting_int('outbox.wait_poll_interval',
        @extschema@.outbox_setting_raw('outbox.wait_poll_interval'), 10, 'ms', 1, 60000) / 1000.0;
    look constant text := format('SELECT %s', work_due::regprocedure);
    due boolean;
BEGIN
    LOOP
        EXECUTE look INTO due;
        IF due THEN
            RETURN true;
        END IF;
        EXIT WHEN clock_timestamp() >= deadline;
        PERFORM pg_sleep(least(poll_s, extract(epoch FROM deadline - clock_timestamp())));
    END LOOP;
    RETURN false;
END
$$;

-- Nothing but the version is granted to PUBLIC (privileges.sql revokes the native build's
-- functions; these are this build's own).
REVOKE ALL ON FUNCTION
    @extschema@.outbox_setting_raw(text),
    @extschema@.outbox_setting_database(text),
    @extschema@.outbox_setting_trusted(),
    @extschema@.outbox_setting_denied(text, text, text),
    @extschema@.outbox_setting_int(text, text, bigint, text, bigint, bigint),
    @extschema@.outbox_setting_error(text, text),
    @extschema@.outbox_setting_bool(text, boolean),
    @extschema@.outbox_topic_list_match(text, text, text)
FROM PUBLIC;
