//! Which of the Kafka producers (lanes) an event travels in. librdkafka puts one partition in
//! each produce request and a connection carries one request at a time, so a round touching k
//! partitions of a broker on one connection waits for k requests in a row. Each lane is a
//! producer with its own connections; an event goes to the lane of its partition, so a round's
//! partitions are written side by side. librdkafka still picks the partition itself.

use std::collections::HashMap;
use std::sync::RwLock;

use rdkafka::statistics::Statistics;

use crate::store::Event;

/// Partition counts of the topics the producers know, from librdkafka's statistics (no request
/// of its own). A topic not known yet is routed by its key's hash alone.
#[derive(Default)]
pub struct PartitionCounts(RwLock<HashMap<String, u32>>);

impl PartitionCounts {
    /// Takes the counts of one statistics report (librdkafka's `-1`, messages not yet
    /// partitioned, is not a partition).
    pub fn note(&self, s: &Statistics) {
        let mut counts = self.0.write().expect("partition counts");
        for (name, topic) in &s.topics {
            let n = topic.partitions.keys().filter(|&&p| p >= 0).count();
            if let Ok(n @ 1..) = u32::try_from(n) {
                counts.insert(name.clone(), n);
            }
        }
    }

    pub fn get(&self, topic: &str) -> Option<u32> {
        self.0.read().expect("partition counts").get(topic).copied()
    }
}

/// Kafka's default partitioner (the Java client's, librdkafka's `murmur2_random`) for a key's
/// hash: the positive 31 bits of murmur2 with Kafka's seed.
fn key_hash(key: &str) -> u32 {
    murmur2::murmur2(key.as_bytes(), murmur2::KAFKA_SEED) & 0x7fff_ffff
}

/// The partition Kafka's default partitioner gives `key` in a topic of `partitions`.
pub fn partition_of_key(key: &str, partitions: u32) -> u32 {
    key_hash(key) % partitions.max(1)
}

/// The lane of `ev` among `lanes`: a keyed event's partition modulo the lanes (its key's hash
/// when the partition count is unknown, the same lane when the lanes divide the partitions), an
/// unkeyed event's id modulo the lanes (librdkafka picks its partition at random).
pub fn lane_of(ev: &Event, partitions: Option<u32>, lanes: usize) -> usize {
    let slot = match (&ev.key, partitions) {
        (Some(k), Some(p)) => u64::from(partition_of_key(k, p)),
        (Some(k), None) => u64::from(key_hash(k)),
        (None, _) => ev.id.unsigned_abs(),
    };
    (slot % lanes.max(1) as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: i64, key: Option<&str>) -> Event {
        crate::sink::tests::ev(id, "orders", key, true)
    }

    #[test]
    fn keys_land_where_the_java_client_puts_them() {
        // What kafka-clients 4.4.0 computes: toPositive(Utils.murmur2(key)) % 12.
        assert_eq!(partition_of_key("order-1", 12), 10);
        assert_eq!(partition_of_key("a", 12), 4);
        assert_eq!(partition_of_key("customer-42", 12), 9);
    }

    #[test]
    fn a_lane_carries_whole_partitions() {
        for k in 0..200 {
            let key = format!("order-{k}");
            let p = partition_of_key(&key, 8);
            let ev = event(k, Some(&key));
            assert_eq!(lane_of(&ev, Some(8), 4), (p % 4) as usize);
            // Unknown count: the lanes still divide 8 partitions the same way.
            assert_eq!(lane_of(&ev, None, 4), (p % 4) as usize);
            assert_eq!(lane_of(&ev, Some(3), 1), 0);
        }
    }

    #[test]
    fn unkeyed_events_spread_by_id() {
        let lanes: Vec<usize> = (0..8)
            .map(|id| lane_of(&event(id, None), Some(4), 4))
            .collect();
        assert_eq!(lanes, [0, 1, 2, 3, 0, 1, 2, 3]);
    }
}
