//! A Kafka broker that shuts down can answer a metadata request without listing any broker;
//! librdkafka then forgets every broker it knew and never connects again (its issue 5301). The
//! relay replaces the producer after a failed health request, so it finds the broker once it is
//! back: its own breaker, broker watch and publisher, in process, against a real broker.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_tests::broker::Broker;
use outbox_worker::breaker::{probe_loop, Breaker};
use outbox_worker::health::Health;
use outbox_worker::kafka_metrics::KafkaMetrics;
use outbox_worker::maintenance::broker_watch;
use outbox_worker::metrics::Metrics;
use outbox_worker::publisher::Publisher;
use outbox_worker::sink::{Outcome, Sink};
use outbox_worker::store::Event;
use tokio_util::sync::CancellationToken;

/// Stop-and-start cycles tried until the publisher gets an answer listing no broker.
const CYCLES: usize = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_reaches_a_restarted_broker_that_had_answered_without_brokers() {
    let (_broker, publisher) = publisher_without_brokers().await;
    let metrics = Metrics::new(Health::new(1, Duration::from_secs(60), "Kafka"));
    let breaker = Arc::new(Breaker::new());
    let cancel = CancellationToken::new();
    assert!(breaker.trip());
    let prober = tokio::spawn(probe_loop(
        breaker.clone(),
        publisher.clone(),
        Duration::from_secs(1),
        metrics.clone(),
        cancel.clone(),
    ));
    let t = Instant::now();
    tokio::time::timeout(Duration::from_secs(30), breaker.wait_closed(&cancel))
        .await
        .expect("the breaker closes once the broker is back");
    cancel.cancel();
    prober.await.expect("prober").expect("prober result");
    assert_replaced(&metrics, "closed", t);

    let (outcomes, _) = publisher.publish(&[event()]).await;
    assert!(
        matches!(outcomes[..], [Outcome::Delivered { .. }]),
        "{outcomes:?}"
    );
}

/// An idle relay runs no rounds and never opens its breaker: its broker watch, asking every
/// `--stats-interval`, must replace the producer so that /ready says the broker is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_relays_broker_watch_reaches_a_broker_that_had_answered_without_brokers() {
    let (_broker, publisher) = publisher_without_brokers().await;
    let metrics = Metrics::new(Health::new(1, Duration::from_secs(60), "Kafka"));
    metrics.health.db_result(true);
    metrics.health.set_broker_reachable(false);
    let cancel = CancellationToken::new();
    let watch = tokio::spawn(broker_watch(
        publisher.clone(),
        Arc::new(Breaker::new()),
        metrics.clone(),
        Duration::from_millis(200),
        Duration::from_secs(1),
        cancel.clone(),
    ));
    let t = Instant::now();
    while let Err(why) = metrics.health.ready() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "not ready after 30 s: {why}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cancel.cancel();
    watch.await.expect("watch").expect("watch result");
    assert_replaced(&metrics, "ready", t);
}

/// A publisher whose producer got an answer listing no broker while the broker stopped (up to
/// `CYCLES` stop-and-start cycles), with the broker running again; checks that, left alone, the
/// producer does not reach it.
async fn publisher_without_brokers() -> (Broker, Arc<Publisher>) {
    let mut broker = Broker::start();
    broker.create_topic("orders");
    let registry = prometheus::Registry::new();
    let kafka_metrics = Arc::new(KafkaMetrics::register(&registry));
    let publisher = Arc::new(
        Publisher::new(
            &broker.addr(),
            Duration::from_secs(1),
            &[],
            1,
            kafka_metrics,
        )
        .expect("publisher"),
    );
    let mut cycles = 0;
    loop {
        cycles += 1;
        let empty_answer = stop_asking(&mut broker, &publisher).await;
        tokio::task::block_in_place(|| broker.start_again());
        if empty_answer {
            break;
        }
        assert!(
            cycles < CYCLES,
            "no answer without brokers in {CYCLES} shutdowns"
        );
        wait_healthy(&*publisher, Duration::from_secs(20)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        publisher.health(Duration::from_secs(1)).await.is_err(),
        "librdkafka reached the broker again by itself (issue 5301 fixed?)"
    );
    (broker, publisher)
}

/// Stops the broker while asking it for metadata in a loop; whether an answer listed no broker.
async fn stop_asking(broker: &mut Broker, publisher: &Arc<Publisher>) -> bool {
    let stopped = Arc::new(AtomicBool::new(false));
    let asker = {
        let (publisher, stopped) = (publisher.clone(), stopped.clone());
        tokio::spawn(async move {
            let mut empty_answer = false;
            while !stopped.load(Ordering::Relaxed) {
                match publisher.metadata(Duration::from_millis(100)).await {
                    Ok((0, _)) => empty_answer = true,
                    Ok(_) => {}
                    Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
            empty_answer
        })
    };
    tokio::task::block_in_place(|| broker.stop());
    stopped.store(true, Ordering::Relaxed);
    asker.await.expect("asker")
}

async fn wait_healthy(publisher: &dyn Sink, within: Duration) {
    let t = Instant::now();
    while let Err(e) = publisher.health(Duration::from_secs(1)).await {
        assert!(
            t.elapsed() < within,
            "no answer from the restarted broker: {e}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// At least one producer was replaced after a failed health request since `t` (`what`: closed,
/// ready).
fn assert_replaced(metrics: &Metrics, what: &str, t: Instant) {
    let replaced = metrics
        .producer_replaced
        .with_label_values(&["unreachable"])
        .get();
    assert!(
        replaced >= 1,
        "{what} after {:?} without a new producer",
        t.elapsed()
    );
}

fn event() -> Event {
    Event {
        id: 1,
        event_id: "0190a1b2-0000-7000-8000-000000000001".into(),
        topic: "orders".into(),
        key: Some("k".into()),
        event_type: None,
        payload: "{}".into(),
        headers: "{}".into(),
        claim_token: 1,
        retry_count: 0,
        age_at_claim: 0.0,
        created_at_ms: 0,
        ordered: true,
    }
}
