//! The ack audit: a trigger in the scratch database records each row's turn to SUCCESS with the
//! session that made it (every relay's `application_name` is its owner name) and the claim the
//! row was under. Needed because an acked row keeps the claim it was under: a late ack that got
//! past the fence would leave the new holder's owner and token behind, indistinguishable from
//! that holder's own ack.

use super::runner::Runner;

/// Run once in the scratch database before any relay starts. The trigger fires inside the
/// SECURITY DEFINER `outbox_ack` (search_path pg_catalog): hence the qualified names.
pub(super) const INSTALL: &str = "
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
CREATE TRIGGER fault_record_ack AFTER UPDATE OF status ON public.outbox_event
FOR EACH ROW WHEN (NEW.status = 'SUCCESS' AND OLD.status IS DISTINCT FROM 'SUCCESS')
EXECUTE FUNCTION public.fault_record_ack();
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
