-- outbox 0.9.0 -> 0.10.0 (docs/reference.md, "Operations" and "Upgrades").
-- * outbox_stats estimates the delivered history (SUCCESS) from reltuples past 8 MB also when a
--   table was never vacuumed nor analyzed (reltuples -1): it counts that table while it is small
--   and takes it as empty while it is big. Before, one such table sent every call to an exact
--   count over outbox_event. The tracked table never has a row while no key is busy and nothing
--   fails, so every call read the whole stream's history (a relay calls it every 5 s).
-- No table changes; events in flight are not touched.
\echo Use "ALTER EXTENSION outbox UPDATE TO '0.10.0'" to load this file. \quit

CREATE OR REPLACE FUNCTION @extschema@.outbox_stats(
    OUT due_wait bigint,
    OUT delayed_wait bigint,
    OUT sending bigint,
    OUT failed bigint,
    OUT succeeded bigint,
    OUT oldest_due_age interval,
    OUT oldest_lease_age interval,
    OUT blocked_keys bigint,
    OUT oldest_blocked_age interval
)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    stamp timestamptz := clock_timestamp();
    -- Below this size (both tables together, or one table) a count is cheap.
    small constant bigint := 8 * 1024 * 1024;
    est bigint;
    stream_wait bigint;
    stream_oldest timestamptz;
BEGIN
    -- Loads the library (and so the outbox.* settings) for relays that read them after this call.
    PERFORM @extschema@.outbox_config();
    -- Every count below reads a partial index whose size follows the backlog, not the history
    -- (WAIT rows: the unordered ones' and the ordered keys' index).
    SELECT count(*) FILTER (WHERE w.next_retry_time <= stamp),
           count(*) FILTER (WHERE w.next_retry_time > stamp),
           stamp - min(w.next_retry_time) FILTER (WHERE w.next_retry_time <= stamp)
      INTO due_wait, delayed_wait, oldest_due_age
      FROM (SELECT e.next_retry_time FROM @extschema@.outbox_tracked e
             WHERE e.status = 'WAIT' AND NOT e.ordered
            UNION ALL
            SELECT e.next_retry_time FROM @extschema@.outbox_tracked e
             WHERE e.ordered AND e.status <> 'SUCCESS' AND e.status = 'WAIT') w;
    -- Stream events past the cursor (committed ones: a plain read sees no other), read as
    -- outbox_stream_take reads them, so the cost follows the backlog.
    SELECT count(*), min(w.created_at) INTO stream_wait, stream_oldest
      FROM (SELECT v.* FROM @extschema@.outbox_stream_cursor v ORDER BY v.version DESC LIMIT 1) c
      CROSS JOIN LATERAL (
          SELECT e.created_at FROM @extschema@.outbox_stream e
           WHERE (e.txid, e.id) >
                 (CASE WHEN c.pos_txid >= pg_snapshot_xmax(c.prev_snap)
                       THEN c.pos_txid ELSE pg_snapshot_xmax(c.prev_snap) END,
                  CASE WHEN c.pos_txid >= pg_snapshot_xmax(c.prev_snap) THEN c.pos_id ELSE 0 END)
          UNION ALL
          SELECT e.created_at FROM pg_snapshot_xip(c.prev_snap) x
            JOIN @extschema@.outbox_stream e ON e.txid = x
           WHERE (e.txid, e.id) > (c.pos_txid, c.pos_id)
      ) w;
    due_wait := due_wait + stream_wait;
    oldest_due_age := CASE WHEN stream_oldest IS NULL THEN oldest_due_age
                           ELSE greatest(oldest_due_age, stamp - stream_oldest) END;
    SELECT count(*), stamp - min(e.claimed_at)
      INTO sending, oldest_lease_age
      FROM @extschema@.outbox_tracked e WHERE e.status = 'SENDING';
    SELECT sending + coalesce(sum(cardinality(b.pending)), 0),
           greatest(oldest_lease_age, stamp - min(b.claimed_at))
      INTO sending, oldest_lease_age
      FROM @extschema@.outbox_stream_batch b
     WHERE b.claim_token >= (SELECT v.batch_floor FROM @extschema@.outbox_stream_cursor v
                              ORDER BY v.version DESC LIMIT 1);
    SELECT count(*) INTO failed FROM @extschema@.outbox_tracked e WHERE e.status = 'FAIL';
    -- Keys held back by a dead head, and since when that head has been dead.
    SELECT count(*), stamp - min(h.updated_at)
      INTO blocked_keys, oldest_blocked_age
      FROM @extschema@.outbox_key k
      CROSS JOIN LATERAL (
          SELECT e.updated_at FROM @extschema@.outbox_tracked e
           WHERE e.topic = k.topic AND e.event_key = k.event_key AND e.ordered
             AND e.status <> 'SUCCESS'
           ORDER BY e.id
           LIMIT 1
      ) h
     WHERE k.due_at = 'infinity';
    -- SUCCESS rows are the history: count them exactly while the tables are small, estimate
    -- from the planner's statistics (reltuples) beyond that.
    IF pg_relation_size('@extschema@.outbox_tracked'::regclass)
       + pg_relation_size('@extschema@.outbox_stream'::regclass) < small THEN
        SELECT count(*) INTO succeeded FROM @extschema@.outbox_event e WHERE e.status = 'SUCCESS';
    ELSE
        -- A table never vacuumed nor analyzed has no estimate (-1): count its rows while it is
        -- small, else take it as empty until autovacuum has seen it. Before 0.10.0 such a table
        -- sent every call to the exact count over outbox_event: a tracked table that never had
        -- a row (no busy key, no failure) made each call read the whole stream's history.
        SELECT sum(CASE WHEN c.reltuples >= 0 THEN c.reltuples::bigint
                        WHEN pg_relation_size(c.oid) >= small THEN 0
                        WHEN c.oid = '@extschema@.outbox_tracked'::regclass
                        THEN (SELECT count(*) FROM @extschema@.outbox_tracked)
                        ELSE (SELECT count(*) FROM @extschema@.outbox_stream) END)
          INTO est
          FROM pg_class c
         WHERE c.oid IN ('@extschema@.outbox_tracked'::regclass, '@extschema@.outbox_stream'::regclass);
        succeeded := greatest(est - due_wait - delayed_wait - sending - failed, 0);
    END IF;
END
$$;

