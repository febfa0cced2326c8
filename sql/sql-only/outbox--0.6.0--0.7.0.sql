-- outbox 0.6.0 -> 0.7.0, the SQL-only side (scripts/sql-only puts it before the native step): the
-- owner check reads the owner of outbox_tracked, the table outbox_event was renamed to.
CREATE OR REPLACE FUNCTION @extschema@.outbox_setting_trusted() RETURNS boolean
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- plpgsql: created before the table it names.
    RETURN pg_has_role(CASE WHEN current_setting('role') = 'none' THEN session_user::text
                            ELSE current_setting('role') END::name,
                       (SELECT c.relowner FROM pg_class c WHERE c.oid = '@extschema@.outbox_tracked'::regclass),
                       'MEMBER');
END
$$;
