-- Owners and reclaim: heartbeats, and taking back claims past their lease or whose owner is gone.

-- A claimer is alive until now + timeout (returned; zero: it stops). Given `previous`, the expiry
-- its last beat returned, a row holding another means another process beats as this owner:
-- 55006, the row left as it is. Past expiry, outbox_reclaim takes back what it claimed before.
CREATE FUNCTION @extschema@.outbox_heartbeat(owner text, timeout interval DEFAULT '30 seconds',
                                             previous timestamptz DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    -- Wall clock, as the claim's claimed_at: a beat inside a long transaction is still now.
    stamp timestamptz := clock_timestamp();
    holder timestamptz;
BEGIN
    PERFORM @extschema@.outbox_check_owner('outbox_heartbeat', owner);
    -- The upper bound keeps stamp + timeout inside timestamptz's range.
    IF timeout IS NULL OR timeout < interval '0' OR timeout > interval '100 years' THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'outbox_heartbeat: timeout must be an interval from 0 to 100 years',
            DETAIL = format('timeout = %s', coalesce(timeout::text, 'NULL'));
    END IF;
    -- A conflicting row is locked even when the WHERE keeps it as it is.
    INSERT INTO @extschema@.outbox_owner AS o (owner, started_at, beat_at, expires_at)
    VALUES (owner, stamp, stamp, stamp + timeout)
    ON CONFLICT ON CONSTRAINT outbox_owner_pkey
    DO UPDATE SET beat_at = excluded.beat_at, expires_at = excluded.expires_at
     WHERE previous IS NULL OR o.expires_at = previous;
    IF NOT FOUND THEN
        holder := (SELECT o.expires_at FROM @extschema@.outbox_owner o WHERE o.owner = owner);
        RAISE EXCEPTION USING ERRCODE = 'object_in_use',
            MESSAGE = format('outbox_heartbeat: another process beats as owner %L', owner),
            DETAIL = format('Its beat runs until %s; this caller''s last one ran until %s.', holder, previous),
            HINT = 'Give each claimer an owner of its own.';
    END IF;
    RETURN stamp + timeout;
END
$$;

-- The claimers, for operators (outbox-worker relays): every owner with a heartbeat row or a
-- claim, whether it is alive (NULL: it never beat, so its claims go back after their lease only),
-- and how many events it holds since when.
CREATE FUNCTION @extschema@.outbox_owners(max_rows int DEFAULT 100)
RETURNS TABLE (owner text, alive boolean, started_at timestamptz, beat_at timestamptz,
               expires_at timestamptz, held bigint, oldest_claim timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    stamp timestamptz := clock_timestamp();
BEGIN
    PERFORM @extschema@.outbox_check_count('outbox_owners', 'max_rows', max_rows, 100000);
    RETURN QUERY
    WITH claims AS (
        SELECT t.claim_owner AS who, count(*) AS n, min(t.claimed_at) AS since
          FROM @extschema@.outbox_scheduled t
         WHERE t.status = 'SENDING'
         GROUP BY t.claim_owner
        UNION ALL
        -- From the floor on (outbox_stream_cursor.batch_floor): below it every batch is settled.
        SELECT b.claim_owner, sum(cardinality(b.pending)), min(b.claimed_at)
          FROM @extschema@.outbox_stream_batch b
         WHERE b.claim_token >= (SELECT c.batch_floor FROM @extschema@.outbox_cursor() c)
         GROUP BY b.claim_owner
    ), holders AS (
        SELECT c.who, sum(c.n)::bigint AS n, min(c.since) AS since FROM claims c GROUP BY c.who
    )
    SELECT coalesce(o.owner, h.who), o.expires_at >= stamp, o.started_at, o.beat_at, o.expires_at,
           coalesce(h.n, 0), h.since
      FROM @extschema@.outbox_owner o
      FULL JOIN holders h ON h.who = o.owner
     ORDER BY 1
     LIMIT max_rows;
END
$$;

-- Why outbox_reclaim takes back a claim that owner made at claimed_at, as its last_error, or NULL
-- when it does not: the lease ended, or the owner's heartbeat ran out after it claimed (gone_owners
-- and gone_at: the owners whose heartbeat has run out, and when).
CREATE FUNCTION @extschema@.outbox_reclaim_reason(owner text, claimed_at timestamptz,
                                                  stamp timestamptz, lease interval,
                                                  gone_owners text[], gone_at timestamptz[])
RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN claimed_at < stamp - lease
                THEN format('lease expired: claimed by %s at %s, not settled within %s',
                            owner, claimed_at, lease)
                WHEN claimed_at <= g.at
                THEN format('owner gone: claimed by %s at %s, whose heartbeat ran out at %s',
                            owner, claimed_at, g.at)
           END
      FROM (SELECT gone_at[array_position(gone_owners, owner)] AS at) g
$$;

-- outbox_reclaim_returning's stream part: batches past their lease, or whose owner is gone (the
-- same rule); their events become scheduled copies after one failed attempt. SKIP LOCKED: a batch
-- locked right now is being settled.
CREATE FUNCTION @extschema@.outbox_reclaim_batches(stamp timestamptz, lease interval, gone_owners text[],
                                                   gone_at timestamptz[], max_retry int)
RETURNS TABLE (id bigint, topic text, status @extschema@.outbox_status, retry_count int, expired_owner text)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    batch record;
BEGIN
    FOR batch IN
        SELECT b.claim_token, b.claim_owner, b.pending, r.why
          FROM @extschema@.outbox_stream_batch b
         CROSS JOIN LATERAL (SELECT @extschema@.outbox_reclaim_reason(b.claim_owner, b.claimed_at, stamp,
                                                                      lease, gone_owners, gone_at) AS why) r
         WHERE r.why IS NOT NULL
           -- From the floor on (outbox_stream_cursor.batch_floor): below it every batch is settled.
           AND b.claim_token >= (SELECT c.batch_floor FROM @extschema@.outbox_cursor() c)
         ORDER BY b.claim_token
         FOR UPDATE OF b SKIP LOCKED
    LOOP
        DELETE FROM @extschema@.outbox_stream_batch b WHERE b.claim_token = batch.claim_token;
        RETURN QUERY
        SELECT m.id, m.topic, m.status, m.retry_count, batch.claim_owner
          FROM @extschema@.outbox_stream_schedule(batch.pending,
                   @extschema@.outbox_status_after_failure(1, max_retry), 1, stamp, batch.why, stamp) m
         ORDER BY m.id;
        PERFORM @extschema@.outbox_keys_wait(batch.pending, stamp);
    END LOOP;
END
$$;

-- Expired claims back to WAIT (or FAIL): claims past their lease, and claims whose owner's
-- heartbeat ran out (outbox_heartbeat). Returns each reclaimed row with its new state and the
-- owner that held it, so the caller can log and count the dead letters it made.
CREATE FUNCTION @extschema@.outbox_reclaim_returning(lease interval DEFAULT NULL)
RETURNS TABLE (id bigint, topic text, status @extschema@.outbox_status, retry_count int, expired_owner text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cfg record;
    stamp timestamptz := clock_timestamp();
    done int;
    gone_owners text[];
    gone_at timestamptz[];
    reclaimed_ids bigint[];
    owners text[];
    topics text[];
    event_keys text[];
    batch_rows int;
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
    -- Owners whose heartbeat ran out, and when (outbox_reclaim_reason). Few rows, read whole.
    SELECT coalesce(array_agg(o.owner), '{}'), coalesce(array_agg(o.expires_at), '{}')
      INTO gone_owners, gone_at
      FROM @extschema@.outbox_owner o
     WHERE o.expires_at < stamp;
    -- A reclaim counts as a failed attempt, so a poison event that kills its relay ends as a dead
    -- letter. SKIP LOCKED: a locked row is being settled by its holder; never wait for it.
    WITH expired AS MATERIALIZED (
        SELECT x.id, x.claim_owner FROM @extschema@.outbox_scheduled x
         WHERE x.status = 'SENDING'
           AND @extschema@.outbox_reclaim_reason(x.claim_owner, x.claimed_at, stamp, lease,
                                                 gone_owners, gone_at) IS NOT NULL
         ORDER BY x.id
         FOR UPDATE SKIP LOCKED
    ), reclaimed AS (
        UPDATE @extschema@.outbox_scheduled e
           SET retry_count = e.retry_count + 1,
               status = @extschema@.outbox_status_after_failure(e.retry_count + 1, cfg.max_retry),
               next_retry_time = stamp,
               last_error = @extschema@.outbox_reclaim_reason(e.claim_owner, e.claimed_at, stamp,
                                                              lease, gone_owners, gone_at),
               claim_owner = NULL, claim_token = NULL, claimed_at = NULL, updated_at = stamp
         -- Locked above, so still as expired saw them; the state is checked again all the same.
         WHERE e.id = ANY (ARRAY(SELECT expired.id FROM expired)) AND e.status = 'SENDING'
           AND @extschema@.outbox_reclaim_reason(e.claim_owner, e.claimed_at, stamp, lease,
                                                 gone_owners, gone_at) IS NOT NULL
        RETURNING e.id, e.topic, e.event_key, e.ordered
    )
    SELECT array_agg(r.id), array_agg(x.claim_owner),
           array_agg(r.topic) FILTER (WHERE r.ordered), array_agg(r.event_key) FILTER (WHERE r.ordered)
      INTO reclaimed_ids, owners, topics, event_keys
      FROM reclaimed r JOIN expired x ON x.id = r.id;
    PERFORM @extschema@.outbox_keys_wake(topics, event_keys, stamp);
    RETURN QUERY
    SELECT e.id, e.topic, e.status, e.retry_count, o.owner
      FROM unnest(reclaimed_ids, owners) AS o(id, owner)
      JOIN @extschema@.outbox_scheduled e ON e.id = o.id
     ORDER BY e.id;
    done := coalesce(cardinality(reclaimed_ids), 0);
    RETURN QUERY SELECT * FROM @extschema@.outbox_reclaim_batches(stamp, lease, gone_owners, gone_at, cfg.max_retry);
    GET DIAGNOSTICS batch_rows = ROW_COUNT;
    -- Owners gone for longer than a lease hold nothing the lease has not taken back (a claim
    -- skipped above as locked included): their rows go, so the table stays as small as the
    -- set of live claimers.
    IF cardinality(gone_owners) > 0 THEN
        DELETE FROM @extschema@.outbox_owner o WHERE o.expires_at < stamp - lease;
    END IF;
    IF done + batch_rows > 0 AND cfg.notify THEN
        PERFORM pg_notify('outbox', '');
    END IF;
END
$$;

-- outbox_reclaim_returning, counted.
CREATE FUNCTION @extschema@.outbox_reclaim(lease interval DEFAULT NULL)
RETURNS int
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT count(*)::int FROM @extschema@.outbox_reclaim_returning(lease)
$$;
