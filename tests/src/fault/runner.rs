//! The fault injector: relay processes in slots (spawned, reaped, respawned under a new owner
//! name), and the faults a run makes: SIGKILL of a relay, broker outage, broker restart,
//! `pg_terminate_backend` of the relays' connections. The zombie is in `zombie.rs`.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use tokio::runtime::Runtime;
use tokio_postgres::Client;

use super::profile::{Profile, Rng};
use super::report::Report;
use super::scrape::{scrape, Counters};
use crate::broker::Broker;
use crate::relay::Relay;

pub(super) struct Slot {
    pub(super) index: usize,
    pub(super) generation: usize,
    pub(super) owner: String,
    pub(super) worker: Relay,
    /// What it counted as of its last scrape (None: it never answered one).
    pub(super) counters: Option<Counters>,
}

pub(super) struct Runner<'a> {
    pub(super) p: &'a Profile,
    pub(super) rt: &'a Runtime,
    pub(super) db_url: String,
    pub(super) admin: Client,
    pub(super) broker: Option<Broker>,
    pub(super) port: u16,
    pub(super) slots: Vec<Slot>,
    pub(super) rng: Rng,
    pub(super) start: Instant,
    pub(super) report: Report,
    /// Owners that were SIGKILLed / frozen as the zombie.
    pub(super) killed_owners: HashSet<String>,
    pub(super) zombie_owner: Option<String>,
    pub(super) last_scrape: Instant,
}

impl Runner<'_> {
    pub(super) fn t(&self) -> String {
        format!("t={:6.1}s", self.start.elapsed().as_secs_f64())
    }

    pub(super) fn log(&mut self, line: String) {
        let line = format!("{} {line}", self.t());
        eprintln!("[fault] {line}");
        self.report.faults.push(line);
    }

    pub(super) fn spawn(&self, index: usize, generation: usize) -> Slot {
        let owner = format!("fault-w{index}-g{generation}");
        let broker = format!("127.0.0.1:{}", self.port);
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        // Its sessions carry its owner name: the ack audit tells relays apart by it.
        let db_url = format!("{} application_name={owner}", self.db_url);
        let worker = Relay::spawn(
            &db_url,
            &broker,
            &[
                "--owner",
                &owner,
                "--lease",
                &ms(self.p.lease),
                "--send-timeout",
                &ms(self.p.send_timeout),
                "--reclaim-interval",
                &ms(self.p.reclaim_interval),
                "--poll-interval",
                &ms(self.p.poll_interval),
                "--stats-interval",
                "2s",
                "--batch-size",
                &self.p.batch_size.to_string(),
                "--concurrency",
                &self.p.concurrency.to_string(),
                "--kafka-property",
                "reconnect.backoff.max.ms=250",
                "--kafka-property",
                &format!("batch.size={}", super::reject::RELAY_BATCH_BYTES),
            ],
        );
        Slot {
            index,
            generation,
            owner,
            worker,
            counters: None,
        }
    }

    /// Scrapes one relay's /metrics; an answer without a metric the runner relies on is
    /// reported (a violation), not read as 0.
    pub(super) fn scrape(&mut self, i: usize) {
        match scrape(&self.slots[i].worker) {
            Ok(Some(c)) => self.slots[i].counters = Some(c),
            Ok(None) => {}
            Err(e) => {
                let line = format!("{}: {e}", self.slots[i].owner);
                if !self.report.metrics_problems.contains(&line) {
                    self.report.metrics_problems.push(line);
                }
            }
        }
    }

    /// Scrapes every relay, at most once a second.
    pub(super) fn scrape_all(&mut self) {
        if self.last_scrape.elapsed() < Duration::from_secs(1) {
            return;
        }
        for i in 0..self.slots.len() {
            self.scrape(i);
        }
        self.last_scrape = Instant::now();
    }

    /// Adds what a relay counted (its last scrape) to the report before the relay is dropped.
    pub(super) fn harvest(&mut self, i: usize) {
        let owner = self.slots[i].owner.clone();
        let Some(c) = self.slots[i].counters.clone() else {
            self.report.unscraped.push(owner);
            return;
        };
        let r = &mut self.report;
        r.failed_transient += c.failed_transient;
        r.failed_permanent += c.failed_permanent;
        for (reason, n) in &c.replaced {
            *r.replacements.entry(reason.clone()).or_default() += n;
        }
        if c.producer_failures > 0 {
            r.producer_failures += c.producer_failures;
            if c.replaced_total() == 0 {
                r.not_replaced.push(owner.clone());
            }
            r.producer_failure_workers.push(owner);
        }
    }

    pub(super) fn respawn(&mut self, i: usize) {
        self.harvest(i);
        let (index, generation) = (self.slots[i].index, self.slots[i].generation + 1);
        let slot = self.spawn(index, generation);
        self.slots[i] = slot;
    }

    /// Restarts workers that exited on their own (e.g. a fatal producer error).
    pub(super) fn reap(&mut self) {
        for i in 0..self.slots.len() {
            if let Some(st) = self.slots[i].worker.wait_exit(Duration::ZERO) {
                let owner = self.slots[i].owner.clone();
                let tail: Vec<String> = self.slots[i]
                    .worker
                    .logs()
                    .lines()
                    .rev()
                    .filter(|l| l.contains("ERROR") || l.contains("rror"))
                    .take(1)
                    .map(str::to_string)
                    .collect();
                self.report
                    .unexpected_exits
                    .push(format!("{owner} {st} {}", tail.join(" ")));
                self.log(format!("{owner} exited by itself ({st}); restarted"));
                self.killed_owners.insert(owner);
                self.respawn(i);
            }
        }
    }

    pub(super) fn query_i64(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> i64 {
        self.rt
            .block_on(self.admin.query_one(sql, params))
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .get(0)
    }

    pub(super) fn kill_one(&mut self) {
        let i = self.rng.below(self.slots.len() as u64) as usize;
        let owner = self.slots[i].owner.clone();
        let held = self.query_i64(
            "SELECT count(*) FROM outbox_event WHERE status = 'SENDING' AND claim_owner = $1",
            &[&owner],
        );
        // What it counted, as late as possible: nothing can be read once it is dead.
        self.scrape(i);
        self.slots[i].worker.signal(libc::SIGKILL);
        self.slots[i].worker.wait_exit(Duration::from_secs(10));
        self.killed_owners.insert(owner.clone());
        self.report.kills += 1;
        self.log(format!(
            "SIGKILL {owner} (holding about {held} claimed rows); restarted"
        ));
        self.respawn(i);
    }

    pub(super) fn terminate_connections(&mut self) {
        let n = self.query_i64(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND application_name LIKE 'fault-w%' \
             AND pid <> pg_backend_pid()) t",
            &[],
        );
        self.report.terminated_connections.push(n);
        self.log(format!("pg_terminate_backend of {n} worker connections"));
    }

    pub(super) fn outage(&mut self) {
        if let Some(b) = &self.broker {
            b.freeze();
        }
        self.log(format!(
            "broker SIGSTOP (outage of {} s, send timeout {} ms)",
            self.p.outage_for.as_secs_f64(),
            self.p.send_timeout.as_millis()
        ));
        std::thread::sleep(self.p.outage_for);
        if let Some(b) = &self.broker {
            b.thaw();
        }
        self.report.outages += 1;
        self.log("broker SIGCONT".to_string());
    }

    pub(super) fn restart_broker(&mut self) {
        let t = Instant::now();
        if let Some(b) = self.broker.as_mut() {
            b.restart();
        }
        self.report.restarts += 1;
        self.log(format!(
            "broker restart: SIGTERM, then the same broker started again on the same ports and data; answering again after {:.1} s, workers kept running",
            t.elapsed().as_secs_f64()
        ));
    }
}
