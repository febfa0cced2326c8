-- outbox 0.11.0 -> 0.12.0 (docs/reference.md, "Upgrades"; docs/relay.md, "Stopping").
-- * outbox_claim rolls back a claim whose client died while it ran. PostgreSQL runs a statement
--   to its end after its client is gone (it finds out when it answers) and commits it, so a relay
--   SIGKILLed with a claim in flight left that claim's events SENDING for a dead owner until the
--   lease ended (10 minutes). outbox_client_connected() (Rust: poll(2) of the session's socket
--   for the peer's close) is the look; the SQL-only build's version always says yes.
-- No table changes; events in flight are not touched.
\echo Use "ALTER EXTENSION outbox UPDATE TO '0.12.0'" to load this file. \quit

-- native-only begin
CREATE FUNCTION @extschema@."outbox_client_connected"() RETURNS bool
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'outbox_client_connected_wrapper';
-- native-only end
REVOKE ALL ON FUNCTION @extschema@.outbox_client_connected() FROM PUBLIC;

CREATE OR REPLACE FUNCTION @extschema@.outbox_claim(owner text, max_events int DEFAULT 20)
RETURNS SETOF @extschema@.outbox_event
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cfg record;
    token bigint;
    -- Wall clock, not transaction start: a claim inside a long transaction must not stamp an old lease.
    stamp timestamptz := clock_timestamp();
    lease interval;
    skip_dead boolean;
    -- What the visit of the due keys saw, one element per row: the key row (locked), its key
    -- and due time, and one of its unfinished events (NULL for a key with none).
    v_rows tid[];
    v_topics text[];
    v_names text[];
    v_due timestamptz[];
    v_ids bigint[];
    v_status @extschema@.outbox_status[];
    v_retry timestamptz[];
    v_claimed timestamptz[];
    v_pos bigint[];
    v_runnable boolean[];
    v_held boolean[];
    -- Keys of the stream's unsettled batches, and the stream's cursor: see "held" below.
    busy_hashes bigint[];
    cur record;
    key_topics text[];
    key_names text[];
    tracked_ids bigint[];
    stream_ids bigint[];
    lo_id bigint;
    hi_id bigint;
BEGIN
    PERFORM @extschema@.outbox_check_isolation('outbox_claim');
    PERFORM @extschema@.outbox_check_owner('outbox_claim', owner);
    SELECT * INTO cfg FROM @extschema@.outbox_config();
    IF max_events IS NULL OR max_events < 1 OR max_events > cfg.max_claim THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = format('outbox_claim: max_events must be between 1 and %s (outbox.max_claim)', cfg.max_claim),
            DETAIL = format('max_events = %s', coalesce(max_events::text, 'NULL'));
    END IF;
    token := nextval('@extschema@.outbox_claim_token_seq');
    lease := make_interval(secs => cfg.lease_ms / 1000.0);
    -- missing_ok: the SQL-only build has no registered setting (its outbox_config() checks the value).
    skip_dead := lower(coalesce(current_setting('outbox.head_of_line', true), '')) = 'skip';

    -- One statement, so the batches and the cursor that counts them agree (outbox_stream_take
    -- writes a batch and the floor below it in one transaction).
    SELECT v.prev_snap, v.cur_snap, v.pos_txid, v.pos_id,
           ARRAY(SELECT DISTINCT k FROM @extschema@.outbox_stream_batch b, unnest(b.keys) k
                  WHERE b.claim_token >= v.batch_floor) AS busy
      INTO cur
      FROM @extschema@.outbox_stream_cursor v ORDER BY v.version DESC LIMIT 1;
    busy_hashes := cur.busy;

    -- The due ordered keys, oldest due first, each with its unfinished events from its head in
    -- commit (= id) order: as far as they are runnable (WAIT and due), and the head in any case.
    -- Rows are pulled until the batch is full, and a key row is locked (SKIP LOCKED: concurrent
    -- claimers split the keys) only when it is reached, so a claim visits as few keys as fill it:
    -- ten keys with runs of 50 rather than 500 keys with one event each, whose key rows would
    -- all be written twice (here and at the ack). At most 1,000 keys (an idle one costs an
    -- advisory lock below) and max_events rows per key (so a hot key's backlog is never read
    -- past what a batch can take).
    -- A key's event is held while the stream still owes an earlier event of the key: one in an
    -- unsettled stream batch (that holds the whole key), or one the stream's cursor has not
    -- reached (it becomes a tracked row, before this one, when the cursor gets there). By the
    -- stream's rule the nearest stream event of the key below the tracked one tells.
    SELECT array_agg(c.row_id), array_agg(c.topic), array_agg(c.event_key), array_agg(c.due_at),
           array_agg(c.id), array_agg(c.status), array_agg(c.next_retry_time),
           array_agg(c.claimed_at), array_agg(c.pos), array_agg(c.runnable), array_agg(c.held)
      INTO v_rows, v_topics, v_names, v_due, v_ids, v_status, v_retry, v_claimed, v_pos, v_runnable, v_held
      FROM (SELECT k.ctid AS row_id, k.topic, k.event_key, k.due_at, p.id, p.status,
                   p.next_retry_time, p.claimed_at, p.pos, coalesce(p.runnable, false) AS runnable,
                   coalesce(p.held, false) AS held
              FROM (SELECT d.ctid, d.topic, d.event_key, d.due_at,
                           @extschema@.outbox_key_hash(d.topic, d.event_key) AS hash
                      FROM @extschema@.outbox_key d
                     WHERE d.due_at <= stamp
                     ORDER BY d.due_at
                     LIMIT least(max_events, 1000)
                     FOR UPDATE SKIP LOCKED) k
              LEFT JOIN LATERAL (
                  SELECT r.* FROM (
                      SELECT u.*, bool_and(u.status = 'WAIT' AND u.next_retry_time <= stamp AND NOT u.held)
                                      OVER (ORDER BY u.pos) AS runnable
                        FROM (SELECT e.id, e.status, e.next_retry_time, e.claimed_at,
                                     row_number() OVER (ORDER BY e.id) AS pos,
                                     CASE WHEN e.status <> 'WAIT' OR e.next_retry_time > stamp THEN false
                                          WHEN k.hash = ANY (busy_hashes) THEN true
                                          ELSE EXISTS (
                                              SELECT 1
                                                FROM (SELECT q.id, q.txid FROM @extschema@.outbox_stream q
                                                       WHERE q.key_hash = k.hash AND q.id < e.id
                                                       ORDER BY q.id DESC LIMIT 1) q
                                               WHERE NOT @extschema@.outbox_stream_passed(q.txid, q.id, cur.prev_snap, cur.cur_snap,
                                                                                           cur.pos_txid, cur.pos_id)
                                                 AND NOT EXISTS (SELECT 1 FROM @extschema@.outbox_stream_early x WHERE x.id = q.id)
                                                 AND NOT EXISTS (SELECT 1 FROM @extschema@.outbox_tracked t WHERE t.id = q.id))
                                     END AS held
                                FROM @extschema@.outbox_tracked e
                               WHERE e.topic = k.topic AND e.event_key = k.event_key
                                 AND e.ordered AND e.status <> 'SUCCESS'
                                 AND NOT (e.status = 'FAIL' AND (skip_dead OR e.skipped_at IS NOT NULL))
                               ORDER BY e.id
                               LIMIT max_events) u
                  ) r
                   WHERE r.runnable OR r.pos = 1
              ) p ON true
             LIMIT max_events) c;

    -- The one statement that decides ownership of tracked rows. A key's run is the prefix of its unfinished
    -- events (from its head) that are WAIT and due: nothing after a held, backing-off or dead
    -- event. Unordered events are claimed as before, SKIP LOCKED. The batch is cut by due time
    -- with a key's run ranked as one block, so a cut keeps a prefix.
    WITH pending AS MATERIALIZED (
        SELECT t.*
          FROM unnest(v_rows, v_topics, v_names, v_due, v_ids, v_status, v_retry, v_claimed, v_pos, v_runnable, v_held)
               AS t(row_id, topic, event_key, key_due, id, status, next_retry_time, claimed_at, pos, runnable, held)
    ), unordered AS MATERIALIZED (
        SELECT c.id, c.next_retry_time
          FROM @extschema@.outbox_tracked c
         WHERE c.status = 'WAIT' AND NOT c.ordered AND c.next_retry_time <= stamp
         ORDER BY c.next_retry_time, c.id
         LIMIT max_events
         FOR UPDATE SKIP LOCKED
    ), chosen AS MATERIALIZED (
        SELECT x.id FROM (
            SELECT p.id, p.key_due AS due, p.row_id AS grp, p.pos FROM pending p WHERE p.runnable
            UNION ALL
            SELECT u.id, u.next_retry_time, NULL::tid, 1 FROM unordered u
        ) x
        ORDER BY x.due, x.grp, x.pos
        LIMIT max_events
    ), claimed AS (
        UPDATE @extschema@.outbox_tracked e
           SET status = 'SENDING', claim_owner = owner, claim_token = token,
               claimed_at = stamp, updated_at = stamp
         WHERE e.id = ANY (ARRAY(SELECT chosen.id FROM chosen)) AND e.status = 'WAIT'
        RETURNING e.*
    ), verdict AS (
        -- When each visited key needs a look next: after its run (the lease, unless settled
        -- sooner), at its head's backoff, never while a dead head blocks it, or it looks idle;
        -- a key the stream holds in a second (or as soon as the batch holding it is settled).
        SELECT h.row_id,
               CASE WHEN h.holding THEN stamp + lease
                    WHEN h.status IS NULL THEN '-infinity'::timestamptz
                    WHEN h.status = 'WAIT' AND h.next_retry_time <= stamp AND h.held THEN stamp + interval '1 second'
                    WHEN h.status = 'WAIT' AND h.next_retry_time <= stamp THEN h.key_due
                    WHEN h.status = 'WAIT' THEN h.next_retry_time
                    WHEN h.status = 'SENDING' THEN greatest(h.claimed_at + lease, stamp + interval '1 second')
                    ELSE 'infinity'::timestamptz
               END AS next_due
          FROM (SELECT p.row_id, min(p.key_due) AS key_due, bool_or(c.id IS NOT NULL) AS holding,
                       bool_or(p.held) FILTER (WHERE p.pos = 1) AS held,
                       min(p.status) FILTER (WHERE p.pos = 1) AS status,
                       min(p.next_retry_time) FILTER (WHERE p.pos = 1) AS next_retry_time,
                       min(p.claimed_at) FILTER (WHERE p.pos = 1) AS claimed_at
                  FROM pending p LEFT JOIN chosen c ON c.id = p.id
                 GROUP BY p.row_id) h
    ), looked AS (
        -- The key rows by their tuple ids: locked above, so they cannot have moved.
        UPDATE @extschema@.outbox_key k SET due_at = v.next_due
          FROM verdict v
         WHERE k.ctid = ANY (v_rows) AND k.ctid = v.row_id AND k.due_at <> v.next_due
    )
    SELECT array_agg(c.id) INTO tracked_ids FROM claimed c;

    -- The rest of the batch from the stream (fresh events), after the retries and
    -- keys above, which are older. The claim's token names the stream batch too.
    IF coalesce(cardinality(tracked_ids), 0) < max_events THEN
        stream_ids := @extschema@.outbox_stream_take(owner, token, stamp,
                                                     max_events - coalesce(cardinality(tracked_ids), 0));
    END IF;
    -- Keys that looked idle are deleted, unless a producer is enqueuing for one right now. The
    -- advisory lock is the producers' own: once it is held, the next statement's snapshot sees
    -- every event they committed, and none can add one before this transaction ends. Only by a
    -- claim that holds the stream's lock (taken above; another holder makes the try fail): a
    -- claim that diverts a busy key's events to tracked rows holds it too, so it never sees a
    -- key row half deleted, and a deletion sees the rows it committed.
    SELECT array_agg(k.topic), array_agg(k.event_key) INTO key_topics, key_names
      FROM @extschema@.outbox_key k
     WHERE k.due_at = '-infinity'
       AND (k.topic, k.event_key) IN (SELECT t.topic, t.event_key
                                        FROM unnest(v_topics, v_names, v_ids) t(topic, event_key, id)
                                       WHERE t.id IS NULL)
       AND pg_try_advisory_xact_lock(@extschema@.outbox_key_lock_id(k.topic, k.event_key));
    IF key_topics IS NOT NULL AND pg_try_advisory_xact_lock(@extschema@.outbox_stream_lock_id()) THEN
        DELETE FROM @extschema@.outbox_key k
         USING unnest(key_topics, key_names) AS t(topic, event_key)
         WHERE k.topic = t.topic AND k.event_key = t.event_key AND k.due_at = '-infinity'
           AND NOT EXISTS (
               SELECT 1 FROM @extschema@.outbox_tracked e
                WHERE e.topic = k.topic AND e.event_key = k.event_key
                  AND e.ordered AND e.status <> 'SUCCESS'
                  AND NOT (e.status = 'FAIL' AND (skip_dead OR e.skipped_at IS NOT NULL)));
    END IF;

    -- The stream rows' ids are mostly consecutive: read them as one primary-key range when the
    -- range holds at most twice as many ids as the batch (id = ANY alone descends the index once
    -- per id, two buffers each), else by id.
    IF cardinality(stream_ids) > 0 THEN
        SELECT min(i), max(i) INTO lo_id, hi_id FROM unnest(stream_ids) i;
        IF hi_id - lo_id >= 2 * cardinality(stream_ids) THEN
            lo_id := NULL;
        END IF;
    END IF;
    -- A claim whose client is gone would hold its events for a dead owner until the lease ends:
    -- PostgreSQL runs a statement to its end after its client died (a relay SIGKILLed with this
    -- claim in flight), and commits it. Roll it back instead; nobody is there to see the error.
    IF (cardinality(tracked_ids) > 0 OR cardinality(stream_ids) > 0)
       AND NOT @extschema@.outbox_client_connected() THEN
        RAISE EXCEPTION USING ERRCODE = 'connection_failure',
            MESSAGE = 'outbox_claim: the client disconnected; the claim is rolled back';
    END IF;
    -- Rows in publish (= id, within a key commit) order: UPDATE ... RETURNING has none.
    RETURN QUERY
    SELECT e.* FROM (
        SELECT t.* FROM @extschema@.outbox_tracked t WHERE t.id = ANY (tracked_ids)
        UNION ALL
        SELECT s.id, s.topic, s.event_key, s.event_type, s.payload, s.headers,
               'SENDING'::@extschema@.outbox_status, 0, s.created_at, owner, token, stamp,
               NULL::text, s.created_at, stamp, s.event_id, s.key_hash IS NOT NULL, NULL::timestamptz
          FROM (SELECT r.* FROM @extschema@.outbox_stream r
                 WHERE r.id BETWEEN lo_id AND hi_id
                 OFFSET 0) s -- a fence: the id list filters the range, it does not drive the scan
          JOIN unnest(stream_ids) u(id) ON u.id = s.id -- hashed, not a search of the list per row
         WHERE lo_id IS NOT NULL
        UNION ALL
        SELECT s.id, s.topic, s.event_key, s.event_type, s.payload, s.headers,
               'SENDING'::@extschema@.outbox_status, 0, s.created_at, owner, token, stamp,
               NULL::text, s.created_at, stamp, s.event_id, s.key_hash IS NOT NULL, NULL::timestamptz
          FROM @extschema@.outbox_stream s
         WHERE lo_id IS NULL AND s.id = ANY (stream_ids)
    ) e
    ORDER BY e.id;
END
$$;

