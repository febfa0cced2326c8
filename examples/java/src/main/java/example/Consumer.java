package example;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.UUID;
import javax.sql.DataSource;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.consumer.OffsetAndMetadata;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.serialization.StringDeserializer;
import org.postgresql.ds.PGSimpleDataSource;
import org.springframework.context.annotation.AnnotationConfigApplicationContext;
import org.springframework.context.annotation.Bean;
import org.springframework.context.annotation.Configuration;
import org.springframework.jdbc.core.JdbcTemplate;
import org.springframework.transaction.annotation.EnableTransactionManagement;
import org.springframework.transaction.annotation.Transactional;

/**
 * Reads the outbox's topic with kafka-clients and applies each event's effect exactly once: a
 * Spring {@code @Transactional} method records the event in the inbox and adds the customer's
 * loyalty points in one transaction; only after its commit is the Kafka offset committed
 * (docs/inbox.md).
 *
 * <pre>
 * java -cp 'target/classes:target/lib/*' example.Consumer DATABASE_URL [BOOTSTRAP_SERVERS]
 *   DATABASE_URL       the consumer's database (with the outbox extension and loyalty_points)
 *   BOOTSTRAP_SERVERS  argument, else $BOOTSTRAP_SERVERS (default: 127.0.0.1:9092)
 *   $OUTBOX_TOPIC      topic to read (default: orders)
 *   $CONSUMER_NAME     the inbox's consumer, a role the database user is a member of (default: loyalty)
 *   $CONSUMER_GROUP    consumer group (default: a new one, so the topic is read from the start)
 *   $CONSUMER_INSTANCE the member's group.instance.id (static membership: a restarted consumer
 *                      takes its partitions back at once instead of after the session timeout)
 *   $IDLE_SECONDS      stop after this long without a message (default: 5; the wait for the
 *                      first message, while the consumer joins its group, is at most 60 s)
 *   $EXIT_AFTER_COMMITS  fault injection: SIGKILL itself after that many database commits,
 *                      before the offset commit (the restarted consumer gets that message again)
 * </pre>
 *
 * Prints {@code applied} for each event applied, {@code duplicate} for each one the inbox had
 * already seen, and a final {@code done} line.
 */
public final class Consumer {
    private Consumer() {}

    /** The effect: PostgreSQL reads the event's JSON payload itself. */
    static final String APPLY = "INSERT INTO loyalty_points (customer, points) "
            + "SELECT e->>'customer', (e->>'points')::bigint FROM (SELECT ?::jsonb AS e) event "
            + "ON CONFLICT (customer) DO UPDATE SET points = loyalty_points.points + EXCLUDED.points";

    /** The inbox and the effect in one transaction: both commit, or neither does. */
    public static class Loyalty {
        private final JdbcTemplate jdbc;

        public Loyalty(JdbcTemplate jdbc) {
            this.jdbc = jdbc;
        }

        @Transactional
        public boolean apply(String consumerName, String eventId, String payloadJson) {
            boolean fresh = Boolean.TRUE.equals(jdbc.queryForObject(
                    "SELECT outbox_inbox_accept(?, ?::uuid)", Boolean.class, consumerName, eventId));
            if (fresh) {
                jdbc.update(APPLY, payloadJson);
            }
            return fresh;
        }
    }

    /** SpringOrders.Config's transaction manager and JdbcTemplate, plus the Loyalty service. */
    @Configuration
    @EnableTransactionManagement
    public static class Config {
        @Bean
        public Loyalty loyalty(JdbcTemplate jdbc) {
            return new Loyalty(jdbc);
        }
    }

    static String header(ConsumerRecord<?, ?> r, String name) {
        Header h = r.headers().lastHeader(name);
        return h == null || h.value() == null ? null : new String(h.value(), StandardCharsets.UTF_8);
    }

    /** The fault of the test: dies like a killed process, without closing anything. */
    static void killSelf() throws IOException, InterruptedException {
        new ProcessBuilder("kill", "-KILL", Long.toString(ProcessHandle.current().pid())).start().waitFor();
        Runtime.getRuntime().halt(137);
    }

    public static void main(String[] args) throws Exception {
        String usage = "usage: example.Consumer DATABASE_URL [BOOTSTRAP_SERVERS]";
        String url = Db.jdbcUrl(Db.arg(args, 0, "DATABASE_URL", usage));
        String servers = args.length > 1 ? args[1] : Db.env("BOOTSTRAP_SERVERS", "127.0.0.1:9092");
        String topic = Db.env("OUTBOX_TOPIC", "orders");
        String consumerName = Db.env("CONSUMER_NAME", "loyalty");
        String group = Db.env("CONSUMER_GROUP", "outbox-example-" + UUID.randomUUID().toString().substring(0, 8));
        String instance = Db.env("CONSUMER_INSTANCE", "");
        Duration idle = Duration.ofMillis((long) (Double.parseDouble(Db.env("IDLE_SECONDS", "5")) * 1000));
        int exitAfter = Integer.parseInt(Db.env("EXIT_AFTER_COMMITS", "0"));

        Properties p = new Properties();
        p.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, servers);
        p.put(ConsumerConfig.GROUP_ID_CONFIG, group);
        if (!instance.isEmpty()) {
            p.put(ConsumerConfig.GROUP_INSTANCE_ID_CONFIG, instance);
        }
        p.put(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG, "earliest");
        p.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false"); // after the database commit
        p.put(ConsumerConfig.KEY_DESERIALIZER_CLASS_CONFIG, StringDeserializer.class.getName());
        p.put(ConsumerConfig.VALUE_DESERIALIZER_CLASS_CONFIG, StringDeserializer.class.getName());

        PGSimpleDataSource ds = new PGSimpleDataSource();
        ds.setURL(url);
        int messages = 0;
        int applied = 0;
        int duplicates = 0;
        try (var ctx = new AnnotationConfigApplicationContext();
                KafkaConsumer<String, String> consumer = new KafkaConsumer<>(p)) {
            ctx.registerBean(DataSource.class, () -> ds);
            ctx.register(SpringOrders.Config.class, Config.class);
            ctx.refresh();
            Loyalty loyalty = ctx.getBean(Loyalty.class);
            consumer.subscribe(List.of(topic));
            // The idle clock starts with the first message: joining the group takes a while.
            long start = System.nanoTime();
            long last = 0;
            while (last == 0 ? System.nanoTime() - start < Duration.ofSeconds(60).toNanos()
                    : System.nanoTime() - last < idle.toNanos()) {
                for (ConsumerRecord<String, String> r : consumer.poll(Duration.ofMillis(500))) {
                    last = System.nanoTime();
                    messages++;
                    String eventId = header(r, "event_id");
                    if (loyalty.apply(consumerName, eventId, r.value())) {
                        applied++;
                        System.out.println("applied key=" + r.key() + " event_id=" + eventId);
                    } else {
                        duplicates++;
                        System.out.println("duplicate key=" + r.key() + " event_id=" + eventId);
                    }
                    if (messages == exitAfter) {
                        System.out.flush();
                        killSelf();
                    }
                    // A crash before this line redelivers the message; the inbox makes it a no-op.
                    consumer.commitSync(Map.of(new TopicPartition(r.topic(), r.partition()),
                            new OffsetAndMetadata(r.offset() + 1)));
                }
            }
        }
        System.out.println("done messages=" + messages + " applied=" + applied + " duplicates=" + duplicates);
    }
}
