-- outbox 0.2.0 -> 0.3.0 (docs/reference.md, "Upgrades").
-- * outbox_nack_returning and outbox_reclaim_returning return the rows they settled with their new
--   state (FAIL = a dead letter), so a relay no longer re-derives the retry rule from a cached
--   outbox.max_retry; outbox_nack and outbox_reclaim keep their signatures and return the count.
-- * The retry rule is written once, in outbox_status_after_failure.
-- * Roles that may call outbox_nack / outbox_reclaim may call their _returning forms: a relay
--   updated together with the extension keeps working with the grants it had.
\echo Use "ALTER EXTENSION outbox UPDATE TO '0.3.0'" to load this file. \quit

-- The retry rule, written once (nack and reclaim): after its n-th failed attempt an event is a
-- dead letter (FAIL) when n exceeds outbox.max_retry, else it waits for its next attempt.
CREATE FUNCTION @extschema@.outbox_status_after_failure(attempts int, max_retry int)
RETURNS @extschema@.outbox_status
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN attempts > max_retry THEN 'FAIL' ELSE 'WAIT' END::@extschema@.outbox_status
$$;

-- One failed attempt for the rows the caller still holds; returns each settled row with its new
-- state, so the caller knows which ones became dead letters without re-deriving the rule.
CREATE FUNCTION @extschema@.outbox_nack_returning(owner text, claim_token bigint, ids bigint[], error text DEFAULT NULL)
RETURNS TABLE (id bigint, topic text, status @extschema@.outbox_status, retry_count int, next_retry_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    cfg record;
    stamp timestamptz := clock_timestamp();
BEGIN
    PERFORM @extschema@.outbox_check_claim_args('outbox_nack', owner, claim_token, ids);
    SELECT * INTO cfg FROM @extschema@.outbox_config();
    -- Backoff after the n-th failure: min(n^2 * base, max) * (1 +/- jitter).
    -- Row locks in id order, the one order of every statement that may wait for a row lock
    -- (reclaim, purge and claim never wait: SKIP LOCKED). Two orders could deadlock.
    RETURN QUERY
    WITH held AS MATERIALIZED (
        SELECT h.id FROM @extschema@.outbox_event h
         WHERE h.id = ANY (ids) AND h.status = 'SENDING'
           AND h.claim_owner = owner AND h.claim_token = claim_token
         ORDER BY h.id
         FOR UPDATE
    ), settled AS (
        UPDATE @extschema@.outbox_event e
           SET retry_count = e.retry_count + 1,
               status = @extschema@.outbox_status_after_failure(e.retry_count + 1, cfg.max_retry),
               next_retry_time = stamp + make_interval(secs =>
                   least(power(e.retry_count + 1, 2) * cfg.backoff_base_ms, cfg.backoff_max_ms)
                   * (1 + cfg.backoff_jitter * (2 * random() - 1)) / 1000.0),
               claim_owner = NULL, claim_token = NULL, claimed_at = NULL,
               -- A nack without a reason keeps the last one instead of erasing it.
               last_error = coalesce(error, e.last_error), updated_at = stamp
         WHERE e.id = ANY (ARRAY(SELECT held.id FROM held)) AND e.status = 'SENDING'
           AND e.claim_owner = owner AND e.claim_token = claim_token
        RETURNING e.id, e.topic, e.status, e.retry_count, e.next_retry_time
    )
    SELECT s.id, s.topic, s.status, s.retry_count, s.next_retry_time FROM settled s ORDER BY s.id;
END
$$;

-- outbox_nack_returning, counted: how many of the ids were still held and settled.
CREATE OR REPLACE FUNCTION @extschema@.outbox_nack(owner text, claim_token bigint, ids bigint[], error text DEFAULT NULL)
RETURNS int
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT count(*)::int FROM @extschema@.outbox_nack_returning(owner, claim_token, ids, error)
$$;

-- Expired claims back to WAIT (or FAIL): returns each reclaimed row with its new state and the
-- owner whose lease expired, so the caller can log and count the dead letters it made.
CREATE FUNCTION @extschema@.outbox_reclaim_returning(lease interval DEFAULT NULL)
RETURNS TABLE (id bigint, topic text, status @extschema@.outbox_status, retry_count int, expired_owner text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cfg record;
    stamp timestamptz := clock_timestamp();
    done int;
BEGIN
    PERFORM @extschema@.outbox_check_isolation('outbox_reclaim');
    SELECT * INTO cfg FROM @extschema@.outbox_config();
    lease := coalesce(lease, make_interval(secs => cfg.lease_ms / 1000.0));
    -- The upper bound keeps stamp - lease inside timestamptz's range (else 22008 from deep inside).
    IF lease <= interval '0' OR lease > interval '100 years' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_reclaim: lease must be a positive interval of at most 100 years',
            DETAIL = format('lease = %s', lease);
    END IF;
    -- Guarded by status and claimed_at in the same statement: a row acked, nacked or renewed
    -- while this runs no longer matches and is left alone. A reclaim counts as a failed attempt,
    -- so a poison event that kills its relay every time still ends as a dead letter.
    -- SKIP LOCKED: a row locked right now is being settled by its holder; never wait for it
    -- (waiting in claimed_at order against acks in id order could deadlock).
    RETURN QUERY
    WITH expired AS MATERIALIZED (
        SELECT x.id, x.claim_owner FROM @extschema@.outbox_event x
         WHERE x.status = 'SENDING' AND x.claimed_at < stamp - lease
         ORDER BY x.id
         FOR UPDATE SKIP LOCKED
    ), reclaimed AS (
        UPDATE @extschema@.outbox_event e
           SET retry_count = e.retry_count + 1,
               status = @extschema@.outbox_status_after_failure(e.retry_count + 1, cfg.max_retry),
               next_retry_time = stamp,
               last_error = format('lease expired: claimed by %s at %s, not settled within %s',
                                   e.claim_owner, e.claimed_at, lease),
               claim_owner = NULL, claim_token = NULL, claimed_at = NULL, updated_at = stamp
         WHERE e.id = ANY (ARRAY(SELECT expired.id FROM expired)) AND e.status = 'SENDING' AND e.claimed_at < stamp - lease
        RETURNING e.id, e.topic, e.status, e.retry_count
    )
    SELECT r.id, r.topic, r.status, r.retry_count, x.claim_owner
      FROM reclaimed r JOIN expired x ON x.id = r.id
     ORDER BY r.id;
    GET DIAGNOSTICS done = ROW_COUNT;
    IF done > 0 AND cfg.notify THEN
        PERFORM pg_notify('outbox', '');
    END IF;
END
$$;

-- outbox_reclaim_returning, counted.
CREATE OR REPLACE FUNCTION @extschema@.outbox_reclaim(lease interval DEFAULT NULL)
RETURNS int
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT count(*)::int FROM @extschema@.outbox_reclaim_returning(lease)
$$;

REVOKE ALL ON FUNCTION
    @extschema@.outbox_status_after_failure(int, int),
    @extschema@.outbox_nack_returning(text, bigint, bigint[], text),
    @extschema@.outbox_reclaim_returning(interval)
FROM PUBLIC;

DO $$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT a.grantee::regrole AS grantee, p.proname
          FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
         WHERE p.oid IN ('@extschema@.outbox_nack(text, bigint, bigint[], text)'::pg_catalog.regprocedure,
                         '@extschema@.outbox_reclaim(interval)'::pg_catalog.regprocedure)
           AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0
           AND a.grantee <> p.proowner
    LOOP
        IF g.proname = 'outbox_nack' THEN
            EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION @extschema@.outbox_nack_returning(text, bigint, bigint[], text) TO %s', g.grantee);
        ELSE
            EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION @extschema@.outbox_reclaim_returning(interval) TO %s', g.grantee);
        END IF;
    END LOOP;
END
$$;
