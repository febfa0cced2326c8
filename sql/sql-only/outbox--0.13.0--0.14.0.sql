-- outbox 0.13.0 -> 0.14.0, the SQL-only side (scripts/sql-only puts it before the native step): the
-- SQL version of the Rust function the step adds (sql/sql-only/native.sql).
CREATE FUNCTION @extschema@.outbox_xact_late_bound() RETURNS bigint
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF pg_current_xact_id_if_assigned() IS NULL THEN
        RETURN NULL;
    ELSIF current_setting('transaction_isolation') = 'read committed' THEN
        RETURN pg_snapshot_xmax(pg_current_snapshot())::text::bigint;
    END IF;
    RETURN 9223372036854775807;
END
$$;
