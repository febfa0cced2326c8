-- outbox 0.11.0 -> 0.12.0, the SQL-only side (scripts/sql-only puts it before the native step): the
-- SQL version of the Rust function the step adds (sql/sql-only/native.sql).
CREATE FUNCTION @extschema@.outbox_client_connected() RETURNS boolean
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT true $$;
