-- Nothing is granted to PUBLIC (docs/reference.md, "Privileges"): not the tables, not EXECUTE on
-- any outbox_* function of the schema but the SQL-only version marker (an upgrade step ends with
-- this file too). sql/examples/grant-roles.sql grants the producer, relay and admin roles.
REVOKE ALL ON TABLE @extschema@.outbox_event, @extschema@.outbox_scheduled, @extschema@.outbox_stream,
    @extschema@.outbox_stream_cursor, @extschema@.outbox_stream_batch,
    @extschema@.outbox_key, @extschema@.outbox_owner FROM PUBLIC;
REVOKE ALL ON SEQUENCE @extschema@.outbox_event_id_seq, @extschema@.outbox_claim_token_seq FROM PUBLIC;
DO $$
DECLARE
    f pg_catalog.regprocedure;
BEGIN
    FOR f IN SELECT p.oid FROM pg_catalog.pg_proc p
              WHERE p.pronamespace = '@extschema@'::pg_catalog.regnamespace
                AND p.proname LIKE 'outbox\_%' AND p.proname <> 'outbox_sql_only_version'
    LOOP
        EXECUTE pg_catalog.format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;
