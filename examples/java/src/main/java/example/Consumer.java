package example;

import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.HashSet;
import java.util.List;
import java.util.Properties;
import java.util.Set;
import java.util.UUID;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.serialization.StringDeserializer;

/**
 * Reads the outbox's topic with kafka-clients and processes each event once, deduplicating on the
 * {@code event_id} header (the relay delivers at least once: a message can arrive twice).
 *
 * <pre>
 * java -cp 'target/classes:target/lib/*' example.Consumer [BOOTSTRAP_SERVERS]
 *   BOOTSTRAP_SERVERS  argument, else $BOOTSTRAP_SERVERS (default: 127.0.0.1:9092)
 *   $OUTBOX_TOPIC      topic to read (default: orders)
 *   $CONSUMER_GROUP    consumer group (default: a new one, so the topic is read from the start)
 *   $IDLE_SECONDS      stop after this long without a message (default: 5; the wait for the
 *                      first message, while the consumer joins its group, is at most 60 s)
 * </pre>
 *
 * Prints {@code event} for each new event, {@code duplicate} for each copy skipped, and a final
 * {@code done} line.
 */
public final class Consumer {
    private Consumer() {}

    static String header(ConsumerRecord<?, ?> r, String name) {
        Header h = r.headers().lastHeader(name);
        return h == null || h.value() == null ? null : new String(h.value(), StandardCharsets.UTF_8);
    }

    public static void main(String[] args) {
        String servers = args.length > 0 ? args[0] : Db.env("BOOTSTRAP_SERVERS", "127.0.0.1:9092");
        String topic = Db.env("OUTBOX_TOPIC", "orders");
        String group = Db.env("CONSUMER_GROUP", "outbox-example-" + UUID.randomUUID().toString().substring(0, 8));
        Duration idle = Duration.ofMillis((long) (Double.parseDouble(Db.env("IDLE_SECONDS", "5")) * 1000));

        Properties p = new Properties();
        p.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, servers);
        p.put(ConsumerConfig.GROUP_ID_CONFIG, group);
        p.put(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG, "earliest");
        p.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false"); // commit after processing
        p.put(ConsumerConfig.KEY_DESERIALIZER_CLASS_CONFIG, StringDeserializer.class.getName());
        p.put(ConsumerConfig.VALUE_DESERIALIZER_CLASS_CONFIG, StringDeserializer.class.getName());

        // In production this set is a table written in the same transaction as the side effect
        // (INSERT INTO processed_events (event_id) ... ON CONFLICT DO NOTHING), see README.md.
        Set<String> seen = new HashSet<>();
        int messages = 0;
        int duplicates = 0;
        try (KafkaConsumer<String, String> consumer = new KafkaConsumer<>(p)) {
            consumer.subscribe(List.of(topic));
            // The idle clock starts with the first message: joining the group takes a while.
            long start = System.nanoTime();
            long last = 0;
            while (last == 0 ? System.nanoTime() - start < Duration.ofSeconds(60).toNanos()
                    : System.nanoTime() - last < idle.toNanos()) {
                var records = consumer.poll(Duration.ofMillis(500));
                for (ConsumerRecord<String, String> r : records) {
                    last = System.nanoTime();
                    messages++;
                    String eventId = header(r, "event_id");
                    if (!seen.add(eventId)) {
                        duplicates++;
                        System.out.println("duplicate key=" + r.key() + " event_id=" + eventId);
                        continue;
                    }
                    // process(r.value()) goes here
                    System.out.println("event key=" + r.key() + " event_id=" + eventId
                            + " type=" + header(r, "event_type"));
                }
                if (!records.isEmpty()) {
                    consumer.commitSync();
                }
            }
        }
        System.out.println("done messages=" + messages + " unique=" + seen.size() + " duplicates=" + duplicates);
    }
}
