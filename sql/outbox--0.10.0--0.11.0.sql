-- outbox 0.10.0 -> 0.11.0 (docs/reference.md, "Wake-up" and "Upgrades").
-- * outbox_work_due, outbox_wait's look at the queue between empty claims, costs a few index
--   probes whatever the history. Its stream probe was an EXISTS that the planner ran as a
--   sequential scan from the stream's first page (it drops an EXISTS' ORDER BY, and guesses that
--   a third of the stream lies past the cursor), so every look on an idle outbox read the whole
--   delivered history (1.46 million events: 350 ms, 38,800 buffers; every 10 ms without the
--   library). Its backoff probe compared with clock_timestamp(), which cannot bound an index
--   scan, and read every event in backoff; it now takes the earliest time from the index (min),
--   as does the key probe.
-- No table changes; events in flight are not touched.
\echo Use "ALTER EXTENSION outbox UPDATE TO '0.11.0'" to load this file. \quit

-- Whether a claim would find something now: a due unordered event, or a due key (one that looked
-- idle counts only once an event of it waits, else a producer still in its transaction would keep
-- it "due" and waiters would spin). outbox_wait's look at the queue, so each probe is an index
-- probe that stops at its first entry, whatever the history or the backlog:
-- - the stream's is a scalar subquery in index order, not EXISTS: the planner drops an EXISTS'
--   ORDER BY and LIMIT, and, guessing that a third of the stream lies past the cursor, scanned the
--   table from its first page (0.7.0 to 0.10.0: the whole delivered history on an idle outbox);
-- - the backoff and key probes read the earliest time from their indexes (min), then compare it
--   with the clock: an EXISTS with clock_timestamp(), which cannot bound an index scan, read
--   every event in backoff (0.10.0 and before).
CREATE OR REPLACE FUNCTION @extschema@.outbox_work_due() RETURNS boolean
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    -- The stream: a committed event past the cursor (a plain read sees only committed rows), in
    -- the range from xmax(prev_snap) or of a transaction prev_snap saw in progress.
    SELECT EXISTS (SELECT 1 FROM (SELECT v.* FROM @extschema@.outbox_stream_cursor v
                                   ORDER BY v.version DESC LIMIT 1) c
                    WHERE (SELECT e.id FROM @extschema@.outbox_stream e
                            WHERE (e.txid, e.id) >
                                  (CASE WHEN c.pos_txid >= pg_snapshot_xmax(c.prev_snap)
                                        THEN c.pos_txid ELSE pg_snapshot_xmax(c.prev_snap) END,
                                   CASE WHEN c.pos_txid >= pg_snapshot_xmax(c.prev_snap)
                                        THEN c.pos_id ELSE 0 END)
                            ORDER BY e.txid, e.id
                            LIMIT 1) IS NOT NULL
                       OR EXISTS (SELECT 1 FROM pg_snapshot_xip(c.prev_snap) x
                                    JOIN @extschema@.outbox_stream e ON e.txid = x
                                   WHERE (e.txid, e.id) > (c.pos_txid, c.pos_id)))
        -- (No such row: min is NULL, and the look must say false, not NULL.)
        OR coalesce((SELECT min(e.next_retry_time) FROM @extschema@.outbox_tracked e
                      WHERE e.status = 'WAIT' AND NOT e.ordered) <= clock_timestamp(), false)
        OR coalesce((SELECT min(k.due_at) FROM @extschema@.outbox_key k WHERE k.due_at > '-infinity')
                    <= clock_timestamp(), false)
        OR EXISTS (SELECT 1 FROM @extschema@.outbox_key k
                    WHERE k.due_at = '-infinity'
                      AND EXISTS (SELECT 1 FROM @extschema@.outbox_tracked e
                                   WHERE e.topic = k.topic AND e.event_key = k.event_key
                                     AND e.ordered AND e.status = 'WAIT'))
$$;

