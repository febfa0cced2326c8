// The Java client's choice of partition, for tests/tests/worker_kafka.rs: a real KafkaProducer
// (the kafka-clients jar of the installed Apache Kafka, default partitioner, StringSerializer)
// sends one record per key read from stdin (UTF-8, one key per line) to TOPIC on BOOTSTRAP and
// prints the partition the broker acknowledged it in, one line per key, in input order.
//
// Run with Java's single-file source launcher:
//   java -cp "$KAFKA_HOME/libs/*" tests/java/JavaProducer.java BOOTSTRAP TOPIC < keys
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.Properties;
import java.util.concurrent.Future;

import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.serialization.StringSerializer;

public class JavaProducer {
    public static void main(String[] args) throws Exception {
        if (args.length != 2) {
            System.err.println("usage: JavaProducer BOOTSTRAP TOPIC < keys");
            System.exit(2);
        }
        List<String> keys = new ArrayList<>();
        try (BufferedReader in = new BufferedReader(
                new InputStreamReader(System.in, StandardCharsets.UTF_8))) {
            for (String line; (line = in.readLine()) != null; ) {
                keys.add(line);
            }
        }
        Properties p = new Properties();
        p.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, args[0]);
        p.put(ProducerConfig.KEY_SERIALIZER_CLASS_CONFIG, StringSerializer.class.getName());
        p.put(ProducerConfig.VALUE_SERIALIZER_CLASS_CONFIG, StringSerializer.class.getName());
        p.put(ProducerConfig.ACKS_CONFIG, "all");
        try (KafkaProducer<String, String> producer = new KafkaProducer<>(p)) {
            List<Future<RecordMetadata>> sent = new ArrayList<>();
            for (String k : keys) {
                sent.add(producer.send(new ProducerRecord<>(args[1], k, k)));
            }
            for (Future<RecordMetadata> f : sent) {
                System.out.println(f.get().partition());
            }
        }
    }
}
