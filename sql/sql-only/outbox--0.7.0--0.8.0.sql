-- outbox 0.7.0 -> 0.8.0, the SQL-only side (scripts/sql-only puts it before the native step): the
-- SQL version of the Rust function the step adds (sql/sql-only/native.sql).
CREATE FUNCTION @extschema@.outbox_xact_late() RETURNS boolean
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT pg_current_xact_id_if_assigned() IS NOT NULL $$;
