-- Key rows (outbox_key): every writer of several key rows writes them in (topic, event_key)
-- order, the one order that keeps two writers from waiting on each other in a cycle.

-- The keys of settled ordered events are due now: the next claim looks at each head (next run,
-- backoff, dead head). Keys without a row have nothing in row state to look at.
CREATE FUNCTION @extschema@.outbox_keys_wake(topics text[], event_keys text[], stamp timestamptz)
RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF topics IS NOT NULL THEN
        UPDATE @extschema@.outbox_key k SET state = 'waiting', due_at = least(k.due_at, stamp)
          FROM (SELECT DISTINCT t.topic, t.event_key FROM unnest(topics, event_keys) AS t(topic, event_key)
                 ORDER BY 1, 2) t
         WHERE k.topic = t.topic AND k.event_key = t.event_key;
    END IF;
END
$$;

-- The key rows of the ordered ones among stream events that become scheduled rows (nacked,
-- released, reclaimed, restored), due at `due` or sooner: from here on their key's claims go
-- through outbox_key.
CREATE FUNCTION @extschema@.outbox_keys_wait(ids bigint[], due timestamptz) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF cardinality(ids) > 0 THEN
        INSERT INTO @extschema@.outbox_key AS k (topic, event_key, state, due_at)
        SELECT DISTINCT s.topic, s.event_key, 'waiting'::@extschema@.outbox_key_state, due
          FROM @extschema@.outbox_stream s
         WHERE s.id = ANY (ids) AND s.key_hash IS NOT NULL
         ORDER BY 1, 2
        ON CONFLICT ON CONSTRAINT outbox_key_pkey
        DO UPDATE SET state = 'waiting', due_at = least(k.due_at, excluded.due_at);
    END IF;
END
$$;

-- A key's run: its unfinished ordered events from its head, in id order, at most max_events, as
-- far as they are runnable (WAIT, due, the key not busy), and its head (pos 1) in any case. No
-- SET clause, so the planner inlines it; every function and operator is named with its schema.
CREATE FUNCTION @extschema@.outbox_key_run(key_topic text, key_name text, busy boolean, skip_dead boolean,
                                           stamp timestamptz, max_events int)
RETURNS TABLE (id bigint, status @extschema@.outbox_status, next_retry_time timestamptz,
               claimed_at timestamptz, pos bigint, runnable boolean)
LANGUAGE sql STABLE
AS $$
    SELECT r.* FROM (
        SELECT e.id, e.status, e.next_retry_time, e.claimed_at,
               pg_catalog.row_number() OVER (ORDER BY e.id) AS pos,
               pg_catalog.bool_and(e.status OPERATOR(pg_catalog.=) 'WAIT'
                                   AND e.next_retry_time OPERATOR(pg_catalog.<=) stamp AND NOT busy)
                   OVER (ORDER BY e.id) AS runnable
          FROM @extschema@.outbox_scheduled e
         WHERE e.topic OPERATOR(pg_catalog.=) key_topic AND e.event_key OPERATOR(pg_catalog.=) key_name
           AND e.ordered AND e.status OPERATOR(pg_catalog.<>) 'SUCCESS'
           AND NOT (e.status OPERATOR(pg_catalog.=) 'FAIL' AND (skip_dead OR e.skipped_at IS NOT NULL))
         ORDER BY e.id
         LIMIT max_events) r
     WHERE r.runnable OR r.pos OPERATOR(pg_catalog.=) 1
$$;

-- Idle key rows a claim visited (and locked) are deleted, unless the key has a head again, and
-- only under the stream's lock: no claim then diverts an event to a key row half deleted.
CREATE FUNCTION @extschema@.outbox_keys_drop_idle(topics text[], event_keys text[], skip_dead boolean)
RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF topics IS NOT NULL AND pg_try_advisory_xact_lock(@extschema@.outbox_stream_lock_id()) THEN
        DELETE FROM @extschema@.outbox_key k
         USING unnest(topics, event_keys) AS t(topic, event_key)
         WHERE k.topic = t.topic AND k.event_key = t.event_key AND k.state = 'idle'
           AND NOT EXISTS (SELECT 1 FROM @extschema@.outbox_key_run(k.topic, k.event_key, false, skip_dead,
                                                                     now(), 1));
    END IF;
END
$$;

-- A visited key's next state and due time (outbox_claim_scheduled; the states are in schema.sql). A
-- due head left unclaimed (the batch was full) keeps the key's place in the due order.
CREATE FUNCTION @extschema@.outbox_key_next(holding boolean, busy boolean,
                                            head_status @extschema@.outbox_status,
                                            head_due timestamptz, head_claimed timestamptz,
                                            key_due timestamptz, stamp timestamptz, lease interval,
                                            OUT state @extschema@.outbox_key_state,
                                            OUT due_at timestamptz)
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT n.state, CASE n.state
                        WHEN 'running' THEN CASE WHEN holding THEN stamp + lease
                                                 ELSE greatest(head_claimed + lease, stamp + interval '1 second') END
                        WHEN 'held' THEN stamp + interval '1 second'
                        WHEN 'waiting' THEN CASE WHEN head_due <= stamp THEN key_due ELSE head_due END
                        WHEN 'idle' THEN stamp
                    END
      FROM (SELECT CASE WHEN holding OR head_status = 'SENDING' THEN 'running'
                        WHEN head_status IS NULL THEN 'idle'
                        WHEN head_status = 'WAIT' AND head_due <= stamp AND busy THEN 'held'
                        WHEN head_status = 'WAIT' THEN 'waiting'
                        ELSE 'blocked'
                   END::@extschema@.outbox_key_state AS state) n
$$;
