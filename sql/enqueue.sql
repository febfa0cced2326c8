-- The producer side: one event, or many of one topic, in the caller's transaction.

-- A key's identity in the stream: 64 bits, so two keys about never share one (if they do, one
-- waits while the other is busy). No SET clause, so the planner inlines it; every function and
-- operator is named with its schema instead.
CREATE FUNCTION @extschema@.outbox_key_hash(topic text, event_key text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT pg_catalog.hashtextextended(topic OPERATOR(pg_catalog.||) '/' OPERATOR(pg_catalog.||) event_key, 0)
$$;

-- Headers are a JSON object of strings, without the names the relay sets itself; `what` names
-- the argument in the error (headers, headers[2]). Raises 22023.
CREATE FUNCTION @extschema@.outbox_check_headers(fn text, what text, headers jsonb) RETURNS void
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    header record;
BEGIN
    IF jsonb_typeof(headers) <> 'object' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: %s must be a JSON object whose values are strings', fn, what),
            DETAIL = format('%s is a JSON %s', what, jsonb_typeof(headers));
    END IF;
    SELECT h.key, jsonb_typeof(h.value) AS kind INTO header FROM jsonb_each(headers) h
     WHERE jsonb_typeof(h.value) <> 'string' OR h.key IN ('event_id', 'event_type', 'event_key', 'outbox_id')
     LIMIT 1;
    IF header.kind <> 'string' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: %s must be a JSON object whose values are strings', fn, what),
            DETAIL = format('header %L is a JSON %s', header.key, header.kind);
    ELSIF FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('%s: %s: header %L is set by the relay and cannot be given', fn, what, header.key);
    END IF;
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
    IF headers <> '{}'::jsonb THEN
        PERFORM @extschema@.outbox_check_headers('outbox_enqueue', 'headers', headers);
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
        -- Due later: a scheduled row, claimed by its next_retry_time. It takes no part in its key's
        -- order (a reminder due tomorrow must not hold the key's other events until then).
        INSERT INTO @extschema@.outbox_scheduled
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

-- outbox_enqueue_many's checks of each element, outbox_enqueue's rules: raises for the first bad
-- one (by position, from 1), before anything is written.
CREATE FUNCTION @extschema@.outbox_check_elements(fn text, payloads jsonb[], keys text[], headers jsonb[])
RETURNS void
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    bad record;
    max_bytes int;
BEGIN
    SELECT u.pos INTO bad FROM unnest(payloads) WITH ORDINALITY u(p, pos) WHERE u.p IS NULL LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'null_value_not_allowed',
            MESSAGE = format('%s: payloads[%s] is NULL (use ''null''::jsonb for a JSON null)', fn, bad.pos);
    END IF;
    PERFORM @extschema@.outbox_check_headers(fn, format('headers[%s]', u.pos), u.h)
       FROM unnest(headers) WITH ORDINALITY u(h, pos)
      WHERE u.h <> '{}'::jsonb
      ORDER BY u.pos;
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
END
$$;

-- Many events of one topic in one call, all or nothing, with outbox_enqueue's checks (errors name
-- the array position, from 1). The arrays are read in step (NULL or as long as payloads); ids come
-- back in array order, which is publish order within a key.
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

    PERFORM @extschema@.outbox_check_elements(fn, payloads, keys, headers);

    -- Ids are drawn in array order; events due later go to outbox_scheduled (unordered, as in
    -- outbox_enqueue), the rest to outbox_stream.
    IF due_later THEN
        RETURN QUERY
        INSERT INTO @extschema@.outbox_scheduled
            (topic, event_key, event_type, payload, headers, status, next_retry_time, ordered)
        SELECT topic, u.k, u.t, u.p, coalesce(u.h, '{}'::jsonb), 'WAIT', deliver_at, false
          FROM unnest(payloads, keys, event_types, headers) WITH ORDINALITY u(p, k, t, h, pos)
         ORDER BY u.pos
        RETURNING outbox_scheduled.id;
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
