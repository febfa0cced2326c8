-- The consumer's inbox (docs/inbox.md): the ids of the events each consumer has applied, written
-- in the transaction of the effect, so an effect commits exactly once per (consumer, event_id).
-- A consumer is a role: it may accept into and read only the inboxes of roles it is a member of.

CREATE TABLE @extschema@.outbox_inbox (
    consumer text NOT NULL,
    event_id uuid NOT NULL,
    accepted_at timestamptz NOT NULL DEFAULT pg_catalog.now(),
    PRIMARY KEY (consumer, event_id)
);
-- Retention by age: rows arrive in accepted_at order, so a BRIN index finds the old ones for a
-- few bytes per page range instead of a B-tree entry (and its WAL) per accept.
CREATE INDEX outbox_inbox_accepted_at ON @extschema@.outbox_inbox USING brin (accepted_at);

-- A role sees and writes the rows of the consumers it is a member of; a consumer whose role was
-- dropped belongs to nobody (to_regrole gives NULL, not an error that would fail every query).
ALTER TABLE @extschema@.outbox_inbox ENABLE ROW LEVEL SECURITY;
CREATE POLICY outbox_inbox_own_consumer ON @extschema@.outbox_inbox
    USING (COALESCE(pg_catalog.pg_has_role(CURRENT_USER,
        pg_catalog.to_regrole(pg_catalog.quote_ident(consumer))::pg_catalog.oid, 'MEMBER'), false))
    WITH CHECK (COALESCE(pg_catalog.pg_has_role(CURRENT_USER,
        pg_catalog.to_regrole(pg_catalog.quote_ident(consumer))::pg_catalog.oid, 'MEMBER'), false));

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_depend d
                WHERE d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass
                  AND d.objid = '@extschema@.outbox_inbox'::pg_catalog.regclass AND d.deptype = 'e') THEN
        PERFORM pg_catalog.pg_extension_config_dump('@extschema@.outbox_inbox', '');
    END IF;
END
$$;

-- Records event_id for consumer: true the first time (apply the effect, commit both together),
-- false for a duplicate (skip it). SECURITY INVOKER, so the row-level policy sees the caller. A
-- concurrent duplicate waits for the first transaction: false once it commits, true if it aborts.
CREATE FUNCTION @extschema@.outbox_inbox_accept(consumer text, event_id uuid)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    consumer_role oid;
BEGIN
    IF consumer IS NULL OR consumer = '' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_inbox_accept: consumer must be a role name, not NULL or empty';
    END IF;
    IF event_id IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_inbox_accept: event_id must not be NULL',
            DETAIL = format('consumer = %s', consumer);
    END IF;
    consumer_role := pg_catalog.to_regrole(pg_catalog.quote_ident(consumer));
    IF consumer_role IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('outbox_inbox_accept: consumer %s is not a role', consumer),
            HINT = 'A consumer is a role (docs/inbox.md, "Privileges"): CREATE ROLE it and GRANT it to the service''s role.';
    END IF;
    IF NOT pg_catalog.pg_has_role(CURRENT_USER, consumer_role, 'MEMBER') THEN
        RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege',
            MESSAGE = format('outbox_inbox_accept: role %s is not a member of consumer %s', CURRENT_USER, consumer);
    END IF;
    INSERT INTO @extschema@.outbox_inbox (consumer, event_id)
    VALUES (outbox_inbox_accept.consumer, outbox_inbox_accept.event_id)
    ON CONFLICT DO NOTHING;
    RETURN FOUND;
END
$$;

-- Deletes up to max_rows rows accepted more than older_than ago, of every consumer; returns how
-- many. Keep older_than above the longest redelivery a consumer can see (docs/inbox.md).
CREATE FUNCTION @extschema@.outbox_inbox_purge(older_than interval DEFAULT '30 days', max_rows int DEFAULT 10000)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cutoff timestamptz;
    done bigint;
BEGIN
    IF older_than IS NULL OR older_than < interval '0' OR older_than > interval '100 years' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_inbox_purge: older_than must be an interval from zero to 100 years',
            DETAIL = format('older_than = %s', coalesce(older_than::text, 'NULL'));
    END IF;
    IF max_rows IS NULL OR max_rows < 1 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_inbox_purge: max_rows must be at least 1',
            DETAIL = format('max_rows = %s', coalesce(max_rows::text, 'NULL'));
    END IF;
    cutoff := pg_catalog.now() - older_than;
    -- Found through the BRIN index, deleted by tuple id; the age is checked again in the DELETE
    -- so a row another purge already took is not counted.
    DELETE FROM @extschema@.outbox_inbox i
     WHERE i.ctid = ANY (ARRAY(SELECT o.ctid FROM @extschema@.outbox_inbox o
                                WHERE o.accepted_at < cutoff LIMIT max_rows))
       AND i.accepted_at < cutoff;
    GET DIAGNOSTICS done = ROW_COUNT;
    RETURN done;
END
$$;

-- The operator's view: per consumer, how many event ids its inbox holds and over what span.
CREATE FUNCTION @extschema@.outbox_inbox_stats()
RETURNS TABLE (consumer text, events bigint, oldest_accepted_at timestamptz, newest_accepted_at timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT i.consumer, pg_catalog.count(*), pg_catalog.min(i.accepted_at), pg_catalog.max(i.accepted_at)
      FROM @extschema@.outbox_inbox i
     GROUP BY i.consumer
     ORDER BY i.consumer
$$;

-- Nothing is granted to PUBLIC (docs/reference.md, "Privileges"); sql/examples/grant-roles.sql
-- grants a consumer role the table and the accept, an admin the purge and the stats.
REVOKE ALL ON TABLE @extschema@.outbox_inbox FROM PUBLIC;
REVOKE ALL ON FUNCTION
    @extschema@.outbox_inbox_accept(text, uuid),
    @extschema@.outbox_inbox_purge(interval, int),
    @extschema@.outbox_inbox_stats()
FROM PUBLIC;
