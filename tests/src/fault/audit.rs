//! The ack audit: triggers in the scratch database record each row's turn to SUCCESS with the
//! session that made it (every relay's `application_name` is its owner name) and the claim the
//! row was under. Needed because an acked row keeps the claim it was under: a late ack that got
//! past the fence would leave the new holder's owner and token behind, indistinguishable from
//! that holder's own ack.
//!
//! Two places an event turns SUCCESS: a scheduled row's status (ordered, delayed and retried
//! events), and a stream event's id leaving its claim's `outbox_stream_batch` row without a
//! scheduled copy (nack, release and reclaim take ids out of the batch too, but leave a copy in
//! `outbox_scheduled`: those are no acks). The settling function may write the copy after the batch
//! row, so the stream's trigger is deferred to commit, when both are there.

use super::runner::Runner;

/// Run once in the scratch database before any relay starts. The scheduled trigger fires inside the
/// SECURITY DEFINER `outbox_ack` (search_path pg_catalog): hence the qualified names. The
/// stream's fires at commit, as the relay's own role: SECURITY DEFINER, so its owner (the
/// superuser that installs it) writes the audit table.
pub(super) const INSTALL: &str = "
-- The producers' aggregates: a transaction locks the rows of its keys before it enqueues, as an
-- order service locks its orders, so per key its events are in commit order.
CREATE TABLE public.fault_aggregate (k text PRIMARY KEY);
INSERT INTO public.fault_aggregate SELECT 'k-' || n FROM generate_series(0, 96) n;
CREATE TABLE public.fault_ack (
    id bigint NOT NULL,
    acker text NOT NULL,
    claim_owner text,
    claim_token bigint,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION public.fault_record_ack() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog AS $$
BEGIN
    INSERT INTO public.fault_ack (id, acker, claim_owner, claim_token)
    VALUES (NEW.id, current_setting('application_name'), OLD.claim_owner, OLD.claim_token);
    RETURN NULL;
END
$$;
CREATE TRIGGER fault_record_ack AFTER UPDATE OF status ON public.outbox_scheduled
FOR EACH ROW WHEN (NEW.status = 'SUCCESS' AND OLD.status IS DISTINCT FROM 'SUCCESS')
EXECUTE FUNCTION public.fault_record_ack();
CREATE FUNCTION public.fault_record_stream_ack() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
DECLARE
    left_over bigint[] := '{}';
BEGIN
    IF TG_OP = 'UPDATE' THEN
        left_over := NEW.pending;
    END IF;
    INSERT INTO public.fault_ack (id, acker, claim_owner, claim_token)
    SELECT p, current_setting('application_name'), OLD.claim_owner, OLD.claim_token
      FROM unnest(OLD.pending) p
     WHERE NOT p = ANY (left_over)
       AND NOT EXISTS (SELECT 1 FROM public.outbox_scheduled t WHERE t.id = p);
    RETURN NULL;
END
$$;
CREATE CONSTRAINT TRIGGER fault_record_stream_ack
AFTER UPDATE OF pending OR DELETE ON public.outbox_stream_batch
DEFERRABLE INITIALLY DEFERRED
FOR EACH ROW EXECUTE FUNCTION public.fault_record_stream_ack();
";

/// Fills the report's audit figures (after every relay stopped).
pub(super) fn check(r: &mut Runner<'_>) {
    let row = r
        .rt
        .block_on(r.admin.query_one(
            "SELECT count(*), count(*) FILTER (WHERE acker IS DISTINCT FROM claim_owner), \
             coalesce((array_agg(id ORDER BY id) FILTER (WHERE acker IS DISTINCT FROM claim_owner))[1:10], '{}') \
             FROM public.fault_ack",
            &[],
        ))
        .expect("ack audit");
    r.report.acks_audited = row.get(0);
    r.report.acks_by_non_holder = row.get(1);
    r.report.acks_by_non_holder_ids = row.get(2);
    if let Some(z) = r.report.zombie.as_mut() {
        // Its session acking rows it had held: under a stale token (the rows had been reclaimed
        // before SIGCONT) or while another relay held them.
        z.late_acks_in_db =
            r.rt.block_on(r.admin.query_one(
                "SELECT count(*) FROM public.fault_ack WHERE acker = $1 AND id = ANY($2) \
                 AND (claim_owner IS DISTINCT FROM $1 OR claim_token = ANY($3))",
                &[&z.owner, &z.ids, &z.tokens],
            ))
            .expect("zombie ack audit")
            .get(0);
    }
}
